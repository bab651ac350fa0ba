"""The RL algorithms `learner.algorithm` names, one module each, and the registry that finds them.

Every built-in keeps the learner's off-policy machinery: the staleness bound of the buffer, and a
correction for the lag between the behaviour policy mu (what the actor sampled with) and the
policy being trained (decoupled PPO's weight pi_prox / mu, or an importance weight against mu).
docs/algorithms.md gives each one's formula, keys and source, and how to add one.

An algorithm from outside this repository is a subclass of `Algorithm` offered under the
`longhorizon.algorithms` entry point (or written as `package.module:Class` in place of a name).
"""

from __future__ import annotations

from longhorizon.common.plugins import PluginError, Registry
from longhorizon.learner.algorithms.base import (
    OPTIONS_KEY,
    Algorithm,
    AlgorithmError,
    CorrectionOptions,
    SumOverRanks,
    SymmetricClipOptions,
    check_clip_range,
)
from longhorizon.common.config import ConfigError

__all__ = [
    "ALGORITHMS",
    "Algorithm",
    "AlgorithmError",
    "CorrectionOptions",
    "SumOverRanks",
    "SymmetricClipOptions",
    "algorithm_class",
    "check_clip_range",
    "make_algorithm",
    "options_schemas",
    "with_resolved_options",
]

# In the order the docs and messages list them.
BUILTINS = {
    "grpo": "longhorizon.learner.algorithms.grpo:GRPO",
    "rloo": "longhorizon.learner.algorithms.rloo:RLOO",
    "reinforce_pp": "longhorizon.learner.algorithms.reinforce_pp:ReinforcePP",
    "dr_grpo": "longhorizon.learner.algorithms.dr_grpo:DrGRPO",
    "dapo": "longhorizon.learner.algorithms.dapo:DAPO",
    "gspo": "longhorizon.learner.algorithms.gspo:GSPO",
    "ppo": "longhorizon.learner.algorithms.ppo:PPO",
    "cispo": "longhorizon.learner.algorithms.cispo:CISPO",
}


def _must_be_an_algorithm(name: str, part) -> None:
    if not (isinstance(part, type) and issubclass(part, Algorithm)):
        raise TypeError(f"algorithm {name!r} is {part!r}, not a subclass of longhorizon.learner.algorithms.Algorithm")


ALGORITHMS: Registry[type[Algorithm]] = Registry("algorithm", "longhorizon.algorithms", BUILTINS,
                                                 check=_must_be_an_algorithm)


def algorithm_class(name: str) -> type[Algorithm]:
    """The algorithm `learner.algorithm = name` names: a built-in, a registered or installed
    plug-in, or a dotted path."""
    try:
        return ALGORITHMS.get(name)
    except (PluginError, TypeError) as error:
        failure = error
    try:
        known = ALGORITHMS.names()
    except PluginError as clash:  # an installed plug-in takes a built-in's name
        raise AlgorithmError(str(clash)) from None
    if ":" not in name and name not in known:
        plugins = sorted(set(known) - set(BUILTINS))
        raise AlgorithmError(
            f"unknown learner.algorithm {name!r}; valid: {', '.join([*BUILTINS, *plugins])}, "
            "or package.module:Class for an Algorithm subclass"
        ) from None
    raise AlgorithmError(f"learner.algorithm {name!r}: {failure}") from failure


def make_algorithm(config) -> Algorithm:
    """The algorithm `config.algorithm` names (`config` is a LearnerConfig), bound to its options
    (`learner.algorithm_options`), after refusing a key of another built-in that it does not take."""
    chosen = algorithm_class(config.algorithm)
    takes = chosen.reads()
    for key in config.algorithm_options:
        readers = [name for name in BUILTINS if key in algorithm_class(name).reads()]
        if key not in takes and readers:
            raise AlgorithmError(
                f"{OPTIONS_KEY}.{key} is not used by learner.algorithm = {config.algorithm!r} (it is read by "
                f"{', '.join(readers)}); remove it or choose one of those"
            )
    return chosen(config)


def with_resolved_options(config):
    """`config` (a whole Config) with `learner.algorithm_options` holding every key of the chosen
    algorithm's options, defaults filled in: what `longhorizon config show` prints. A bad
    algorithm setting is a ConfigError naming the key."""
    try:
        options = make_algorithm(config.learner).options
    except AlgorithmError as error:
        raise ConfigError(str(error)) from None
    resolved = options.model_dump() if options is not None else {}
    return config.replace(learner=config.learner.replace(algorithm_options=resolved))


def options_schemas() -> dict:
    """The JSON schema of each built-in algorithm's options, by name (`longhorizon config schema`)."""
    schemas = {}
    for name in BUILTINS:
        options = algorithm_class(name).Options
        schemas[name] = options.model_json_schema() if options is not None else {"type": "object", "properties": {}}
    return schemas
