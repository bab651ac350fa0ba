"""The env registry, its error messages, reply parsing and terminal play with scripted input."""

import functools
import inspect
import io
import subprocess
import sys

import pytest
import trio

from longhorizon.envs import base
from longhorizon.envs.base import (
    EnvSpec,
    Task,
    action_from_reply,
    env_names,
    env_options,
    get_env_spec,
    list_tasks,
    make_env,
    make_policy,
    react_reply,
    register_env,
    unregister_env,
)
from longhorizon.envs.play import main, play
from longhorizon.envs.textcraft.policies import OraclePolicy, parse_first_observation, plan_actions


def test_builtin_envs_are_listed_and_load_lazily():
    assert {"codebook", "textcraft"} <= set(env_names())
    spec = get_env_spec("codebook")
    assert spec.name == "codebook"
    assert set(spec.policies) == {"oracle", "random"}
    assert make_env("codebook").name == "codebook"


def test_importing_base_does_not_load_the_envs():
    code = "import sys, longhorizon.envs.base; print(sorted(m for m in sys.modules if 'textcraft' in m or 'toy' in m))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_unknown_env_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown env 'nope'.*codebook.*textcraft"):
        get_env_spec("nope")
    with pytest.raises(ValueError, match="unknown env"):
        make_env("nope")


def test_unknown_policy_lists_the_valid_ones():
    with pytest.raises(ValueError, match=r"unknown policy 'genius' for env 'codebook'; valid policies: oracle, random"):
        make_policy("codebook", "genius")


def test_unknown_split_lists_the_valid_ones():
    with pytest.raises(ValueError, match=r"unknown split 'validation'.*train, test"):
        list_tasks("codebook", "validation")


def test_unknown_option_is_named_and_valid_options_listed():
    expected = (r"unknown option 'num_turn' for env 'codebook'; "
                r"valid options: codebook_seed, held_out_sequences, num_actions, num_symbols, num_turns")
    with pytest.raises(ValueError, match=expected):
        make_env("codebook", num_turn=3)
    with pytest.raises(ValueError, match="unknown option 'num_turn'"):
        list_tasks("codebook", "train", num_turn=3)
    with pytest.raises(ValueError, match="unknown option 'num_turn'"):
        make_policy("codebook", "oracle", num_turn=3)


def test_env_options_come_from_the_declared_section():
    assert env_options("codebook") == {"num_turns": 3, "num_symbols": 4, "num_actions": 4, "codebook_seed": 0,
                                        "held_out_sequences": False}
    assert env_options("textcraft") == {"min_depth": 1, "max_depth": 4, "num_distractors": 10}


def _keyword_defaults(function) -> dict:
    return {parameter.name: parameter.default for parameter in inspect.signature(function).parameters.values()
            if parameter.kind is inspect.Parameter.KEYWORD_ONLY}


def _takes_any_keyword(function) -> bool:
    return any(parameter.kind is inspect.Parameter.VAR_KEYWORD
               for parameter in inspect.signature(function).parameters.values())


@pytest.mark.parametrize("name", ["babyai", "codebook", "codechain", "longtail", "remote", "sciworld", "search",
                                  "textcraft", "miniwob", "webarena", "weblocal"])
def test_a_declared_section_is_the_factory_s_own_option_set(name):
    # The section is what users read (docs/config.md) and what is checked; the factory, the task
    # list and every policy are what run: the names and defaults must be the same everywhere.
    spec = get_env_spec(name)
    assert spec.Options is not None
    declared = env_options(name)
    assert _keyword_defaults(spec.factory) == declared
    for function in (spec.tasks, *spec.policies.values()):
        if not _takes_any_keyword(function):
            assert set(_keyword_defaults(function)) >= set(declared), function


def test_a_declared_section_checks_types_and_ranges_in_one_line():
    with pytest.raises(ValueError, match=r"^env 'textcraft': env.options.min_depth must be >= 1, got 0$"):
        list_tasks("textcraft", "train", min_depth=0)
    with pytest.raises(ValueError, match=r"^env 'codebook': env.options.num_turns: expected int, got '3'$"):
        make_env("codebook", num_turns="3")
    with pytest.raises(ValueError, match=r"env.options.long_fraction must be in \[0, 1\], got 2"):
        make_policy("longtail", "oracle", long_fraction=2)
    with pytest.raises(ValueError, match=r"env.options.levels: expected list\[str\] or None, got 'GoTo'"):
        make_env("babyai", levels="GoTo")


def test_a_plugin_env_declares_its_options_and_gets_only_those_given():
    from longhorizon.common.config import Section, bounded

    class MazeOptions(Section):
        """maze: a test env."""

        size: int = bounded(5, ge=2)
        """Cells per side."""
        walls: float = bounded(0.25, ge=0, le=1)
        """Share of cells that are walls."""

    built = []

    def factory(*, size: int = 5, walls: float = 0.25):
        built.append({"size": size, "walls": walls})
        return object()

    register_env(EnvSpec(name="maze-options-test", factory=factory, tasks=lambda split, **options: [],
                         Options=MazeOptions))
    try:
        make_env("maze-options-test", walls=1)  # an int is a float: checked, kept as given
        assert built == [{"size": 5, "walls": 1}]
        with pytest.raises(ValueError, match="env.options.size must be >= 2, got 1"):
            make_env("maze-options-test", size=1)
        with pytest.raises(ValueError, match="unknown option 'doors' for env 'maze-options-test'; valid options: size, walls"):
            make_env("maze-options-test", doors=2)
        assert len(built) == 1
    finally:
        unregister_env("maze-options-test")


def test_the_config_reference_lists_each_env_s_options():
    from longhorizon.envs.base import env_options_schemas
    from longhorizon.launch.config_reference import current_reference

    schemas = env_options_schemas()
    assert set(schemas) >= {"babyai", "codebook", "textcraft", "sciworld", "search"}
    assert schemas["textcraft"]["properties"]["num_distractors"]["minimum"] == 0
    reference = current_reference()
    assert "## [env.options]" in reference and "| `num_distractors` | int | `10` | >= 0 |" in reference


def test_options_reach_factory_tasks_and_policies():
    env = make_env("codebook", num_turns=5, codebook_seed=7)
    assert env.num_turns == 5
    policy = make_policy("codebook", "oracle", num_turns=5, codebook_seed=7)
    assert policy.codebook == env.codebook
    assert all(len(task.data["symbols"]) == 5 for task in list_tasks("codebook", "test", num_turns=5))


class _EchoEnv:
    name = "echo-test"
    prompt_format = "bare"

    def __init__(self, *, loud: bool = False):
        self.loud = loud

    def instructions(self) -> str:
        return ""

    async def reset(self, task, *, seed=None):
        return "hi", {"success": False}

    async def step(self, action):
        return action.upper() if self.loud else action, 0.0, False, False, {"success": False}

    async def close(self):
        pass


def _echo_tasks(split, *, loud=False):
    return [Task(env_name="echo-test", task_id=f"{split}-0", split=split)]


def test_register_custom_env_and_reject_silent_override():
    spec = EnvSpec(name="echo-test", factory=_EchoEnv, tasks=_echo_tasks)
    register_env(spec)
    try:
        assert "echo-test" in env_names()
        assert make_env("echo-test", loud=True).loud is True
        assert list_tasks("echo-test", "test")[0].task_id == "test-0"
        with pytest.raises(ValueError, match="valid policies: \\(none\\)"):
            make_policy("echo-test", "oracle")
        register_env(spec)  # the same spec again (a module imported twice) is not a conflict
        other = EnvSpec(name="echo-test", factory=lambda **options: _EchoEnv(), tasks=_echo_tasks)
        with pytest.raises(ValueError, match="already registered"):
            register_env(other)
        register_env(other, replace=True)
        assert get_env_spec("echo-test") is other
    finally:
        unregister_env("echo-test")
    assert "echo-test" not in env_names()


def test_a_replaced_builtin_comes_back_when_the_replacement_is_unregistered():
    original = get_env_spec("codebook")
    other = EnvSpec(name="codebook", factory=_EchoEnv, tasks=_echo_tasks)
    with pytest.raises(ValueError, match="already registered"):
        register_env(other)
    register_env(other, replace=True)
    try:
        assert get_env_spec("codebook") is other
    finally:
        unregister_env("codebook")
    assert get_env_spec("codebook") is original


def test_register_env_rejects_non_specs():
    with pytest.raises(TypeError, match="EnvSpec"):
        register_env({"name": "x"})


def test_env_protocol_is_checkable():
    assert isinstance(make_env("codebook"), base.Env)
    assert isinstance(make_env("textcraft"), base.Env)
    assert isinstance(make_policy("textcraft", "oracle"), base.ScriptedPolicy)


def test_action_from_reply():
    assert action_from_reply(react_reply("think", "get 1 oak logs"), "react") == "get 1 oak logs"
    assert action_from_reply("Thought:\nhm\n\nAction:\n  inventory  \nmore text", "react") == "inventory"
    assert action_from_reply("Action: craft 1 stick using 2 bamboo", "react") == "craft 1 stick using 2 bamboo"
    assert action_from_reply("  a2 \n", "bare") == "a2"
    # The actor's own parser: garbled replies are errors, not guesses.
    with pytest.raises(ValueError, match="no action found"):
        action_from_reply("no marker here", "react")
    with pytest.raises(ValueError, match="more than one"):
        action_from_reply("Action: get 1 log\nAction: inventory", "react")
    with pytest.raises(ValueError, match="prompt format"):
        action_from_reply("x", "json")


def lines_then_eof(lines):
    remaining = list(lines)

    def input_fn(prompt: str) -> str:
        if not remaining:
            raise EOFError
        return remaining.pop(0)

    return input_fn


def test_play_codebook_with_scripted_input():
    task = list_tasks("codebook", "test")[2]
    codebook = make_env("codebook").codebook
    printed = []
    answers = [codebook[symbol] for symbol in task.data["symbols"]]
    total = play("codebook", split="test", task_index=2, input_fn=lines_then_eof(answers),
                 print_fn=lambda *parts: printed.append(" ".join(map(str, parts))))
    assert total == 1.0
    assert task.data["symbols"][0] in printed
    assert "Success!" in printed


def test_play_textcraft_with_the_oracles_actions():
    tasks = list_tasks("textcraft", "test")
    task_index = next(index for index, task in enumerate(tasks) if task.category == "depth-3")
    env = make_env("textcraft")
    first_observation, _ = trio.run(functools.partial(env.reset, tasks[task_index], seed=4))
    goal_name, listed = parse_first_observation(first_observation)
    actions = [action for _, action in plan_actions(OraclePolicy().book, goal_name, listed)]
    assert len(actions) >= 4
    printed = []
    total = play("textcraft", split="test", task_index=task_index, seed=4,
                 input_fn=lines_then_eof(["", "inventory"] + actions),
                 print_fn=lambda *parts: printed.append(" ".join(map(str, parts))))
    assert total == 1.0
    assert first_observation in printed
    assert "Inventory: You are not carrying anything." in printed
    assert printed[-1] == "Success!"


def test_play_stops_on_quit_and_eof():
    printed = []
    total = play("codebook", input_fn=lines_then_eof(["a0", "quit", "a0"]),
                 print_fn=lambda *parts: printed.append(parts))
    assert total == 0.0
    assert sum(1 for parts in printed if parts and str(parts[0]).startswith("[reward")) == 1
    assert play("codebook", input_fn=lines_then_eof([]), print_fn=lambda *parts: None) == 0.0


def test_play_rejects_a_task_index_out_of_range():
    with pytest.raises(ValueError, match="out of range.*200 tasks"):
        play("codebook", task_index=200, input_fn=lines_then_eof([]), print_fn=lambda *parts: None)


def test_play_takes_the_task_env_serve_numbers_data_idx():
    """`--data-idx` plays what an AgentGym client asking `env serve` for that data_idx gets: for
    TextCraft the reference's own index, whichever split holds it."""
    from longhorizon.envs.service import build_task_table

    table = build_task_table("textcraft", {})
    data_idx = table.data_idx_by_split["test"][1]
    printed = []
    play("textcraft", data_idx=data_idx, input_fn=lines_then_eof([]),
         print_fn=lambda *parts: printed.append(" ".join(map(str, parts))))
    task = table.by_data_idx[data_idx]
    assert any(line.startswith(f"[task {task.task_id} (data_idx {data_idx}, ") for line in printed)
    with pytest.raises(ValueError, match=r"data_idx 9999 names no task of 'textcraft' \(551 tasks: train within 0-\d+"):
        play("textcraft", data_idx=9999, input_fn=lines_then_eof([]), print_fn=lambda *parts: None)


def test_main_reports_bad_input_with_exit_code(capsys, monkeypatch):
    assert main(["nope"]) == 2
    assert "unknown env 'nope'" in capsys.readouterr().err
    assert main(["codebook", "--option", "num_turn=2"]) == 2
    assert "unknown option 'num_turn'" in capsys.readouterr().err
    monkeypatch.setattr("sys.stdin", io.StringIO("a0\na0\n"))
    assert main(["codebook", "--split", "train", "--task", "1", "--option", "num_turns=2"]) == 0
    assert "Total reward:" in capsys.readouterr().out
    with pytest.raises(SystemExit):  # one way of naming the task at a time
        main(["codebook", "--task", "1", "--data-idx", "2"])
    assert "not allowed with argument" in capsys.readouterr().err
