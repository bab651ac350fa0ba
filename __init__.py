"""longhorizon: asynchronous actor-learner reinforcement learning for long-horizon LLM agents.

The Python API (launch/api.py, docs/api.md): `train`, `evaluate`, `collect`, `sft`, `dpo`, `rft`,
`report`, `bench` and `load_config`, imported on first use so that `import longhorizon` stays light.
"""

__version__ = "0.1.0"

_API = {"train", "evaluate", "collect", "sft", "dpo", "rft", "report", "bench", "RunFailed", "TrainResult"}
__all__ = sorted(_API | {"load_config", "Config", "ConfigError"})


def __getattr__(name: str):
    if name in _API:
        from longhorizon.launch import api

        return getattr(api, name)
    if name in ("load_config", "Config", "ConfigError"):
        from longhorizon.common import config

        return getattr(config, name)
    raise AttributeError(f"module 'longhorizon' has no attribute {name!r}")
