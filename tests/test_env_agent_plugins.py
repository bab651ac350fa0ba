"""An env and an agent loop added from a package outside longhorizon, through entry points and
dotted paths, and played through the real rollout, checker, terminal play and env service."""

import io

import pytest

from longhorizon.actor.engines.base import EngineSettings, make_engine
from longhorizon.actor.rollout import AgentLoopSettings, EnvPool, run_episode, run_group
from longhorizon.common.chat import ByteChatTokenizer
from longhorizon.common.config import ConfigError, load_config
from longhorizon.envs.agents import AgentLoopError, agent_loop_names, get_agent_loop, unregister_agent_loop
from longhorizon.envs.base import env_names, get_env_spec, list_tasks, make_env, unregister_env
from longhorizon.envs.checker import check_env
from longhorizon.envs.play import play

# The outside package: a word-typing env (0.5 per word typed, three words a task) with an oracle
# that answers plainly and one that answers in the loop's `ACTION:` lines; and an agent loop that
# reads `ACTION:` lines and shows the model only the first prompt and the last turn.
PLUGIN_SOURCE = '''
from longhorizon.envs.agents import ActionParseError, AgentLoop
from longhorizon.envs.base import EnvSpec, Task

WORDS = {"train": [["apple", "pear", "plum"], ["fig", "kiwi", "lime"]],
         "test": [["oak", "elm", "ash"], ["rose", "iris", "lily"]]}


class WordTypeEnv:
    name = "wordtype"
    prompt_format = "bare"

    def __init__(self, *, reward_per_word: float = 0.5, loop: str = "bare"):
        self.reward_per_word = reward_per_word
        self.prompt_format = loop
        self._words = []
        self._done = True

    def instructions(self):
        return "Type each word you are shown."

    async def reset(self, task, *, seed=None):
        self._words, self._done = list(task.data["words"]), False
        return f"Type the word: {self._words[0]}", {"success": False}

    async def step(self, action):
        if self._done:
            raise RuntimeError("the episode is over")
        if action != self._words[0]:
            return f"Wrong. Type the word: {self._words[0]}", 0.0, False, False, {"success": False, "invalid_action": True}
        self._words.pop(0)
        if not self._words:
            self._done = True
            return "All words typed.", self.reward_per_word, True, False, {"success": True}
        return f"Type the word: {self._words[0]}", self.reward_per_word, False, False, {"success": False}

    async def close(self):
        pass


def word_tasks(split, *, reward_per_word=0.5, loop="bare"):
    return [Task(env_name="wordtype", task_id=f"{split}-{index}", split=split, data={"words": words})
            for index, words in enumerate(WORDS[split])]


class WordOracle:
    def __init__(self, *, reward_per_word=0.5, loop="bare"):
        pass

    def reset(self, task, first_observation, rng):
        pass

    def act(self, observation):
        return observation.rsplit(": ", 1)[-1]


class ActionLineOracle(WordOracle):
    def act(self, observation):
        return f"I read the screen.\\nACTION: {super().act(observation)}"


class WordRandom(WordOracle):
    def reset(self, task, first_observation, rng):
        self.rng = rng

    def act(self, observation):
        return self.rng.choice(["oak", "elm", "apple", "nothing"])


SPEC = EnvSpec(name="wordtype", factory=WordTypeEnv, tasks=word_tasks,
               policies={"oracle": WordOracle, "random": WordRandom, "action_oracle": ActionLineOracle})


def make_spec():
    return SPEC


class ActionLineLoop(AgentLoop):
    name = "action-lines"

    def first_messages(self, instructions, observation):
        return super().first_messages(instructions + " End your reply with one line ACTION: <word>.", observation)

    def parse_action(self, reply):
        actions = [line[len("ACTION:"):].strip() for line in reply.splitlines() if line.startswith("ACTION:")]
        if len(actions) != 1 or not actions[0]:
            raise ActionParseError("write exactly one line ACTION: <word>")
        return actions[0]

    def error_observation(self, error):
        return f"Not understood ({error})."

    def model_view(self, conversation):
        return conversation.last_turns_view(1)


ACTION_LINES = ActionLineLoop()
'''

ENV_ENTRY_POINTS = {"wordtype": "tiny_text_plugins:make_spec", "misnamed": "tiny_text_plugins:SPEC"}
AGENT_ENTRY_POINTS = {"action-lines": "tiny_text_plugins:ActionLineLoop"}
DOTTED_ENV = "tiny_text_plugins:SPEC"
DOTTED_AGENT = "tiny_text_plugins:ACTION_LINES"
ROLLOUT = dict(horizon_cap=6, max_context_tokens=10_000, max_new_tokens=64)


@pytest.fixture
def plugins(install_plugin):
    install_plugin("tiny_text_plugins", PLUGIN_SOURCE,
                   {"longhorizon.envs": ENV_ENTRY_POINTS, "longhorizon.agents": AGENT_ENTRY_POINTS})
    yield
    # The registries keep what they loaded; forget it with the package.
    for name in [*ENV_ENTRY_POINTS, DOTTED_ENV]:
        unregister_env(name)
    for name in [*AGENT_ENTRY_POINTS, DOTTED_AGENT]:
        unregister_agent_loop(name)


def _scripted(env_name, policy="oracle"):
    return make_engine("scripted", EngineSettings(env_name=env_name, scripted_policy=policy))


class RecordingEngine:
    """Passes each request on to an engine and keeps it, to see what the model was shown."""

    def __init__(self, engine):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.policy_version = engine.policy_version
        self.requests = []

    async def generate(self, request):
        self.requests.append(request)
        return await self.engine.generate(request)

    def end_episode(self, episode_id):
        self.engine.end_episode(episode_id)


async def test_an_installed_env_plays_groups_through_the_rollout(plugins):
    assert {"wordtype", "codebook", "textcraft"} <= set(env_names())
    spec = get_env_spec("wordtype")  # the entry point names a function that returns the spec
    assert spec.name == "wordtype" and set(spec.policies) == {"oracle", "random", "action_oracle"}
    task = list_tasks("wordtype", "test")[0]
    assert task.data["words"] == ["oak", "elm", "ash"]
    received = []

    async def keep(trajectory):
        received.append(trajectory)

    trajectories = await run_group(
        _scripted("wordtype"), EnvPool(lambda: make_env("wordtype")), task, group_size=2, group_id="g",
        actor_id="a", seed=0, on_trajectory=keep, **ROLLOUT,
    )
    assert received == trajectories and len(trajectories) == 2
    for trajectory in trajectories:
        # The plug-in's own rewards and observations: 0.5 for each of the three words.
        assert trajectory.success and trajectory.turn_rewards == [0.5, 0.5, 0.5] and trajectory.reward == 1.5
        assert trajectory.env_name == "wordtype" and trajectory.num_turns == 3
        assert "Type the word: elm" in trajectory.text


async def test_an_env_entry_point_must_carry_its_own_name(plugins):
    with pytest.raises(ValueError, match="'misnamed' is an EnvSpec named 'wordtype'"):
        get_env_spec("misnamed")


async def test_a_dotted_path_env_plays_without_installing(plugins):
    spec = get_env_spec(DOTTED_ENV)
    assert spec is get_env_spec("wordtype")
    task = list_tasks(DOTTED_ENV, "train")[1]
    result = await run_episode(make_env(DOTTED_ENV, reward_per_word=0.25), _scripted(DOTTED_ENV), task, **ROLLOUT)
    assert result.success and result.turn_rewards == [0.25, 0.25, 0.25] and result.error == ""
    assert result.conversation.messages[1]["content"] == "Type the word: fig"


def test_the_env_commands_take_plugin_envs(plugins, capsys, monkeypatch):
    from longhorizon.launch.cli import main as cli_main

    assert cli_main(["env", "list"]) == 0
    assert "wordtype" in capsys.readouterr().out.split()
    assert cli_main(["env", "check", DOTTED_ENV, "--policy", "oracle"]) == 0
    assert f"{DOTTED_ENV}: ok" in capsys.readouterr().out
    monkeypatch.setattr("sys.stdin", io.StringIO("rose\niris\nlily\n"))
    assert cli_main(["env", "play", "wordtype", "--task", "1"]) == 0
    assert "Total reward: 1.5" in capsys.readouterr().out


def test_terminal_play_takes_a_plugin_env(plugins):
    typed = iter(["oak", "oak", "elm", "ash"])
    printed = []
    assert play("wordtype", input_fn=lambda prompt: next(typed), print_fn=lambda *parts: printed.append(parts)) == 1.5
    assert ("Wrong. Type the word: elm",) in printed and printed[-1] == ("Success!",)


async def test_the_checker_and_the_env_service_take_plugin_envs(plugins):
    await check_env("wordtype")
    await check_env(DOTTED_ENV, {"reward_per_word": 2.0}, split="test", policy="oracle")

    from longhorizon.envs.remote import make_remote_env
    from longhorizon.envs.server import EnvServer
    from longhorizon.envs.service import ServiceSettings

    with EnvServer(ServiceSettings("wordtype", max_instances=4)) as server:
        assert server.info["env"] == "wordtype" and server.info["num_tasks"] == {"train": 2, "test": 2}
        remote = make_remote_env(server.url, "wordtype")
        task = list_tasks("remote", "test", url=server.url, env="wordtype")[1]
        result = await run_episode(remote, _scripted("wordtype"), task, **ROLLOUT)
        await remote.close()
    assert result.success and result.reward == 1.5 and "Type the word: iris" in result.conversation.text()


async def test_a_served_env_may_name_a_plugin_loop_as_its_prompt_format(plugins):
    # The service says which loop its env's instructions are written for; the client takes any
    # loop installed on its side too, and plays with it.
    from longhorizon.envs.remote import RemoteEnvError, make_remote_env
    from longhorizon.envs.server import EnvServer
    from longhorizon.envs.service import ServiceSettings

    options = {"loop": "action-lines"}
    with EnvServer(ServiceSettings("wordtype", env_options=options)) as server:
        remote = make_remote_env(server.url, "wordtype", env_options=options)
        task = list_tasks("remote", "test", url=server.url, env="wordtype", env_options=options)[0]
        result = await run_episode(remote, _scripted("wordtype", policy="action_oracle"), task, **ROLLOUT)
        assert remote.prompt_format == "action-lines"
        await remote.close()
    assert result.success and result.reward == 1.5

    with EnvServer(ServiceSettings("wordtype", env_options={"loop": "no-such-loop"})) as server:
        remote = make_remote_env(server.url, "wordtype", env_options={"loop": "no-such-loop"})
        task = list_tasks("remote", "test", url=server.url, env="wordtype", env_options={"loop": "no-such-loop"})[0]
        with pytest.raises(RemoteEnvError, match="its prompt_format names no agent loop here"):
            await remote.reset(task)
        await remote.close()


@pytest.mark.parametrize("agent", ["action-lines", DOTTED_AGENT, "tiny_text_plugins:ActionLineLoop"])
async def test_a_plugin_agent_loop_prompts_parses_and_shows_only_the_last_turn(plugins, agent):
    assert "action-lines" in agent_loop_names() and {"react", "bare"} <= set(agent_loop_names())
    engine = RecordingEngine(_scripted("wordtype", policy="action_oracle"))
    task = list_tasks("wordtype", "test")[0]
    result = await run_episode(make_env("wordtype"), engine, task, loop_settings=AgentLoopSettings(agent=agent), **ROLLOUT)
    assert result.error == "" and result.success and result.invalid_actions == 0 and result.reward == 1.5

    conversation = result.conversation
    # The loop's prompt: the env's instructions with the loop's format note.
    assert conversation.messages[0] == {
        "role": "system", "content": "Type each word you are shown. End your reply with one line ACTION: <word>."}
    assert conversation.messages[2]["content"] == "I read the screen.\nACTION: oak"
    # The model saw the first prompt and only its last turn; the trajectory keeps every turn.
    first, second, third = engine.requests
    assert first.token_ids == conversation.token_ids[: conversation.prompt_length]
    assert [m["content"] for m in third.messages] == [
        conversation.messages[0]["content"], "Type the word: oak", "I read the screen.\nACTION: elm", "Type the word: ash"]
    start, end = conversation.turn_starts[1], conversation.turn_starts[2]
    assert third.token_ids == conversation.token_ids[: conversation.prompt_length] + conversation.token_ids[start:end]
    assert third.token_ids == ByteChatTokenizer().prompt_tokens(third.messages)  # a well-formed conversation
    assert len(third.token_ids) < end and len(conversation.messages) == 7


async def test_without_the_loop_the_same_replies_are_not_actions(plugins):
    # The env's own (bare) loop sends the whole reply to the env, which refuses it: what made the
    # episodes above succeed was the plug-in loop's parsing.
    result = await run_episode(make_env("wordtype"), _scripted("wordtype", policy="action_oracle"),
                               list_tasks("wordtype", "test")[0], **ROLLOUT)
    assert not result.success and result.reward == 0.0 and result.truncated
    assert "Wrong. Type the word: oak" in result.conversation.messages[3]["content"]


async def test_a_garbled_reply_gets_the_plugin_loops_error_observation(plugins):
    result = await run_episode(make_env("wordtype"), _scripted("wordtype", policy="oracle"),
                               list_tasks("wordtype", "test")[0],
                               loop_settings=AgentLoopSettings(agent="action-lines"), **ROLLOUT)
    assert result.invalid_actions == 6 and not result.success
    assert result.conversation.messages[3]["content"] == "Not understood (write exactly one line ACTION: <word>)."


def test_unknown_loops_are_named_and_the_config_key_is_checked(plugins, tmp_path):
    with pytest.raises(AgentLoopError, match=r"unknown agent loop 'nope'; available: action-lines, bare, react"):
        get_agent_loop("nope")
    assert get_agent_loop("react").parse_action("Thought: x\nAction: go") == "go"

    from longhorizon.launch.checks import validate_config

    def config(*overrides):
        return load_config(None, [f"run.output_dir={str(tmp_path)!r}", "env.name='wordtype'", "actor.engine='scripted'",
                                  *overrides])

    validate_config(config("actor.agent='action-lines'"))
    validate_config(config(f"actor.agent={DOTTED_AGENT!r}", f"env.name={DOTTED_ENV!r}"))
    assert config().actor.agent == ""  # the default: each env's own prompt format
    with pytest.raises(ConfigError, match="actor.agent: unknown agent loop 'nope'"):
        validate_config(config("actor.agent='nope'"))



def test_actor_agent_reaches_the_episodes_collect_plays(plugins, tmp_path):
    # The config key, not a direct argument: `collect` plays the plug-in env with the plug-in
    # loop, whose parsing is what makes the `ACTION:`-line oracle succeed.
    import json

    from longhorizon.actor.collect import run_collect

    def collect(*overrides):
        config = load_config(None, [f"run.output_dir={str(tmp_path)!r}", "model.path='/nonexistent/model'",
                                    "env.name='wordtype'", "actor.engine='scripted'",
                                    "actor.scripted_policy='action_oracle'", *overrides])
        output = tmp_path / f"play-{len(overrides)}.jsonl"
        run_collect(config, output=output, episodes=2, overwrite=True)
        return [json.loads(line) for line in output.read_text().splitlines()]

    with_loop = collect("actor.agent='action-lines'")
    assert [line["success"] for line in with_loop] == [True, True]
    assert with_loop[0]["messages"][0]["content"].endswith("End your reply with one line ACTION: <word>.")
    assert [line["success"] for line in collect()] == [False, False]
