"""Vision-language policies: a tiny random Idefics3 model (tests/vlm_models.py) shown images by the
hf engine, screenshots attached to observations by the agent loop, carried on the wire, and scored
by the learner with the same pixels, so its log-probs of the sampled tokens are the engine's."""

from __future__ import annotations

import base64
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))

from vlm_models import build_tiny_vlm, png_image  # noqa: E402

from longhorizon.actor.engines.base import EngineSettings, GenerationRequest, make_engine  # noqa: E402
from longhorizon.actor.rollout import AgentLoopSettings, run_episode, to_trajectory  # noqa: E402
from longhorizon.common.chat import TokenConversation, image_model_inputs  # noqa: E402
from longhorizon.common.codec import decode, encode  # noqa: E402
from longhorizon.common.config import LearnerConfig, SamplingConfig  # noqa: E402
from longhorizon.common.models import (  # noqa: E402
    ModelError,
    image_token_ids,
    load_causal_lm,
    load_processor,
    require_processor,
)
from longhorizon.learner.logprobs import Example, pad_examples, token_logprobs  # noqa: E402
from longhorizon.learner.samples import cut, images_of, reply_mask, windows_of  # noqa: E402
from longhorizon.learner.trainer import Trainer  # noqa: E402

RED, BLUE, GREEN = png_image((200, 20, 20)), png_image((20, 20, 200)), png_image((20, 160, 40))


# Rows with one image, two images and none share a batch: the model places each row's image features
# on that row's image tokens, in order.
IMAGE_CONVERSATIONS = [
    [{"role": "user", "content": "click the red button", "images": [RED]}],
    [{"role": "user", "content": "page", "images": [BLUE]},
     {"role": "assistant", "content": "click"},
     {"role": "user", "content": "the blue page", "images": [GREEN]}],
    [{"role": "user", "content": "type done"}],
    [{"role": "user", "content": "click the red button", "images": [BLUE]}],
]


@pytest.fixture(scope="session")
def tiny_vlm(tmp_path_factory) -> Path:
    return build_tiny_vlm(tmp_path_factory.mktemp("models") / "tiny-vlm")


def _engine(folder, **sampling):
    settings = EngineSettings(
        model_path=str(folder), sampling=SamplingConfig(**{"max_new_tokens": 5, "temperature": 1.0, **sampling}),
        max_batch_size=8, seed=3,
    )
    return make_engine("hf", settings)


def _example(prompt: list[int], result, images) -> Example:
    tokens = prompt + result.token_ids
    mask = [0] * len(prompt) + [1] * len(result.token_ids)
    logprobs = [0.0] * len(prompt) + result.logprobs
    return Example(np.array(tokens), np.array(mask, np.float32), np.array(logprobs, np.float32), 0.0,
                   images=tuple(images))


def _largest_difference(model, processor, examples, pad_token_id, temperature: float = 1.0) -> float:
    batch = pad_examples(examples, pad_token_id, image_inputs=lambda images: image_model_inputs(processor, images))
    with torch.no_grad():
        learner, entropy = token_logprobs(model, batch, temperature, with_entropy=True,
                                          suppressed_tokens=image_token_ids(model.config))
    assert bool(torch.isfinite(entropy).all())
    generated = batch.loss_mask > 0
    return (learner[generated] - batch.behaviour_logprobs[generated]).abs().max().item()


def _learner_examples(trajectory) -> list[Example]:
    """A trajectory's training samples as the learner cuts them: one per turn's window, each with
    the images it shows, or the whole trajectory when it has no windows."""
    windows = windows_of(trajectory)
    if not windows:
        return [Example(np.asarray(trajectory.token_ids, np.int64), np.asarray(trajectory.loss_mask, np.float32),
                        np.asarray(trajectory.behaviour_logprobs, np.float32), 0.0, images=images_of(trajectory))]
    prompt_length = int(trajectory.prompt_length)
    return [Example(cut(trajectory.token_ids, prompt_length, start, end).astype(np.int64),
                    reply_mask(trajectory.loss_mask, prompt_length, (start, reply, end)),
                    cut(trajectory.behaviour_logprobs, prompt_length, start, end).astype(np.float32), 0.0,
                    images=images_of(trajectory, (start, reply, end)))
            for start, reply, end in windows]


def test_a_vision_language_folder_loads_with_its_processor_and_a_text_folder_has_none(tiny_vlm, tiny_codebook_model):
    model = load_causal_lm(tiny_vlm)
    assert type(model).__name__ == "Idefics3ForConditionalGeneration"
    assert load_processor(tiny_vlm) is not None
    assert load_processor(tiny_codebook_model) is None
    with pytest.raises(ModelError, match="has no image processor") as error:
        require_processor(tiny_codebook_model)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
async def test_the_learner_scores_the_engines_image_turns_as_the_engine_sampled_them(tiny_vlm, temperature):
    engine = _engine(tiny_vlm, temperature=temperature)
    tokenizer = engine.tokenizer
    cases = IMAGE_CONVERSATIONS
    prompts = [tokenizer.prompt_tokens(messages) for messages in cases]
    images = [[image for message in messages for image in message.get("images", ())] for messages in cases]
    image_token = tokenizer.processor.image_token_id
    assert [prompt.count(image_token) for prompt in prompts] == [4, 8, 0, 4]
    results = [None] * len(cases)

    async def one(index):
        results[index] = await engine.generate(GenerationRequest(
            token_ids=prompts[index], episode_id=str(index), images=images[index]))

    async with trio.open_nursery() as nursery:
        for index in range(len(cases)):
            nursery.start_soon(one, index)

    model, processor = load_causal_lm(tiny_vlm), load_processor(tiny_vlm)
    examples = [_example(prompt, result, row_images) for prompt, result, row_images in zip(prompts, results, images)]
    difference = _largest_difference(model, processor, examples, tokenizer.tokenizer.pad_token_id, temperature)
    print(f"largest |learner - engine| log-prob on the tiny VLM at temperature {temperature}: {difference:.2e}")
    assert difference < 1e-4, difference
    # The images matter: scored with the other colour, the same tokens get other log-probs.
    swapped = [_example(prompts[0], results[0], [BLUE])]
    assert _largest_difference(model, processor, swapped, tokenizer.tokenizer.pad_token_id, temperature) > 1e-3


async def test_a_text_model_asked_for_images_says_so_in_one_line(tiny_codebook_model):
    engine = _engine(tiny_codebook_model)
    with pytest.raises(ValueError, match="no image processor") as error:
        await engine.generate(GenerationRequest(token_ids=[1, 2, 3], episode_id="a", images=[RED]))
    assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match="no image processor"):
        TokenConversation.start(engine.tokenizer, [{"role": "user", "content": "s0", "images": [RED]}])


def test_bad_image_bytes_are_refused_in_one_line(tiny_vlm):
    with pytest.raises(ValueError, match="not a readable image") as error:
        image_model_inputs(load_processor(tiny_vlm), [b"not a png"])
    assert "\n" not in str(error.value)


@dataclass
class _Task:
    task_id: str = "colours-0"
    env_name: str = "colours"


class ColourScreens:
    """A toy env with a screen: each step shows the next colour's image in info["screenshot"]
    (and the set-of-marks key too), as the web env does in its screenshot modes."""

    name = "colours"
    prompt_format = "bare"
    SCREENS = [RED, BLUE, GREEN, RED, BLUE, GREEN]

    def __init__(self, turns: int = 4) -> None:
        self.turns, self.step_count = turns, 0

    def instructions(self) -> str:
        return "click the button"

    def _info(self) -> dict:
        screen = self.SCREENS[self.step_count % len(self.SCREENS)]
        return {"screenshot": screen, "som": screen, "success": False}

    async def reset(self, task, *, seed=None):
        self.step_count = 0
        return "the page", self._info()

    async def step(self, action):
        self.step_count += 1
        done = self.step_count >= self.turns
        return "the page", 1.0 if done else 0.0, done, False, self._info()

    async def close(self):
        pass


class _RecordingEngine:
    """The hf engine, keeping each request it was given."""

    def __init__(self, engine) -> None:
        self.engine, self.tokenizer, self.requests = engine, engine.tokenizer, []

    async def generate(self, request):
        self.requests.append(request)
        return await self.engine.generate(request)

    def end_episode(self, episode_id):
        pass


@pytest.mark.parametrize("history_turns", [0, 2])
async def test_screenshots_ride_with_observations_over_the_wire_to_the_learners_samples(tiny_vlm, history_turns):
    engine = _RecordingEngine(_engine(tiny_vlm, max_new_tokens=3))
    result = await run_episode(
        ColourScreens(turns=5), engine, _Task(), horizon_cap=6, max_context_tokens=2000, max_new_tokens=3,
        seed=0, loop_settings=AgentLoopSettings(history_turns=history_turns, observation_image="screenshot"),
    )
    assert result.error == "" and result.terminated
    trajectory = decode(encode(to_trajectory(result, actor_id="a", task=_Task(), group_id="g", group_size=1,
                                             horizon_cap=6)))
    # The first screen, then one per observation the env stepped to before the end (none after an
    # unreadable reply: the page did not change).
    steps = result.num_turns - result.invalid_actions
    assert steps == 5 and len(trajectory.images) == 1 + steps - 1 == len(trajectory.image_offsets)
    assert trajectory.images == ColourScreens.SCREENS[:5] and trajectory.image_offsets[0] == 0
    assert trajectory.image_offsets == sorted(trajectory.image_offsets)
    image_token = engine.tokenizer.processor.image_token_id
    assert int(np.sum(np.asarray(trajectory.token_ids) == image_token)) == 4 * len(trajectory.images)

    # Each request showed the model exactly the images its tokens hold, and the learner's sample
    # of that turn takes the same ones.
    windows = windows_of(trajectory) or [None] * len(engine.requests)
    assert bool(windows_of(trajectory)) == bool(history_turns)
    model, processor = load_causal_lm(tiny_vlm), load_processor(tiny_vlm)
    for request, window in zip(engine.requests, windows):
        assert request.token_ids.count(image_token) == 4 * len(request.images)
        if window is not None:
            assert list(images_of(trajectory, window)) == request.images
    if history_turns:
        assert any(len(r.images) < len(trajectory.images) for r in engine.requests)  # old screens left out
    else:
        assert engine.requests[-1].images == trajectory.images
    difference = _largest_difference(model, processor, _learner_examples(trajectory),
                                     engine.tokenizer.tokenizer.pad_token_id)
    assert difference < 1e-4, difference


async def test_an_episode_with_screenshots_on_a_text_model_fails_with_the_reason(tiny_codebook_model):
    engine = _engine(tiny_codebook_model)
    result = await run_episode(ColourScreens(), engine, _Task(), horizon_cap=2, max_context_tokens=500,
                               max_new_tokens=3, loop_settings=AgentLoopSettings(observation_image="screenshot"))
    assert "no image processor" in result.error and "\n" not in result.error


def test_the_trainer_updates_a_vision_language_policy_on_image_examples(tiny_vlm):
    model = load_causal_lm(tiny_vlm)
    processor = load_processor(tiny_vlm)
    from longhorizon.common.chat import HFVisionChatTokenizer

    tokenizer = HFVisionChatTokenizer(processor)
    examples = []
    for advantage, image in ((1.0, RED), (-1.0, BLUE)):
        prompt = tokenizer.prompt_tokens([{"role": "user", "content": "click the button", "images": [image]}])
        reply = tokenizer.encode("click red")
        tokens = prompt + reply
        examples.append(Example(
            np.array(tokens), np.array([0] * len(prompt) + [1] * len(reply), np.float32),
            np.array([0.0] * len(prompt) + [-2.0] * len(reply), np.float32), advantage, group=0, images=(image,)))
    # The processor comes from the model's own folder when the trainer is not given one.
    trainer = Trainer(model, LearnerConfig(learning_rate=1e-2), pad_token_id=tokenizer.tokenizer.pad_token_id)
    vision_before = {name: p.detach().clone() for name, p in model.named_parameters() if "vision" in name}
    metrics = trainer.step(examples)
    assert np.isfinite(metrics["loss"])
    changed = [name for name, p in model.named_parameters() if "vision" in name
               and not torch.equal(p.detach(), vision_before[name])]
    assert changed, "the image encoder got no gradient: the images were not in the forward pass"


def test_observation_image_is_refused_before_the_run_for_a_text_model_or_an_engine_without_images(
        tiny_vlm, tiny_codebook_model):
    from longhorizon.common.config import ConfigError, load_config
    from longhorizon.launch.checks import validate_config

    def config(model, *more):
        return load_config(None, [f"model.path={str(model)!r}", "env.name='vlm_models:COLOUR_SPEC'",
                                  "actor.observation_image='screenshot'", *more])

    validate_config(config(tiny_vlm))
    with pytest.raises(ConfigError, match="has no image processor") as error:
        validate_config(config(tiny_codebook_model))
    assert "\n" not in str(error.value)
    with pytest.raises(ConfigError, match="engine cannot show the model images"):
        validate_config(config(tiny_vlm, "actor.engine='scripted'"))


def test_a_trajectorys_images_round_trip_and_bad_ones_are_refused_in_one_line():
    import msgpack

    from longhorizon.common.codec import WireError
    from tests.test_wire import make_trajectory

    trajectory = make_trajectory(images=[RED, BLUE], image_offsets=[0, 6])
    decoded = decode(encode(trajectory))
    assert decoded.images == [RED, BLUE] and decoded.image_offsets == [0, 6]
    assert decode(encode(make_trajectory())).images == []  # text: nothing added

    for images, offsets, reason in [
        ([RED], [], "1 images but 0 image_offsets"),
        ([RED, BLUE], [6, 0], "image_offsets must be in order"),
        ([RED], [12], "image_offsets must be in order and within its 12 tokens"),
    ]:
        with pytest.raises(WireError, match=reason) as error:
            encode(make_trajectory(images=images, image_offsets=offsets))
        assert "\n" not in str(error.value)
    with pytest.raises(WireError, match=r"images\[0\] must be bytes"):
        encode(make_trajectory(images=["not bytes"], image_offsets=[0]))
    # The receiver checks the same, whatever a sender wrote.
    frames = encode(trajectory)
    header = msgpack.unpackb(frames[0], raw=False)
    header["fields"]["images"] = ["text, not bytes", "x"]
    with pytest.raises(WireError, match=r"images\[0\] must be bytes"):
        decode([msgpack.packb(header, use_bin_type=True), *frames[1:]])


def _image_part(png: bytes) -> dict:
    return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(png).decode()}}


def test_serve_model_shows_the_model_images_sent_as_image_url_parts(tiny_vlm):
    """`serve-model` on a vision-language folder: a chat whose user message holds an image as
    OpenAI's `image_url` part (a base64 data URL) is answered as the hf engine answers the same
    conversation with that image, token for token and log-prob for log-prob; another image gives
    other log-probs; what the server cannot take is a 400 naming it."""
    import httpx

    from longhorizon.actor.model_server import ModelServer, start_http_server

    server = ModelServer(str(tiny_vlm), max_batch_size=4)
    httpd = start_http_server(server, "127.0.0.1", 0)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    url = f"{httpd.url}/v1/chat/completions"
    text = "click the red button"

    def chat(*parts, **more) -> httpx.Response:
        messages = [{"role": "user", "content": [{"type": "text", "text": text}, *parts]}, *more.pop("after", [])]
        return httpx.post(url, json={"messages": messages, "max_tokens": 5, "temperature": 0, "logprobs": True,
                                     **more}, timeout=60)

    try:
        red, blue = chat(_image_part(RED)).json(), chat(_image_part(BLUE)).json()
        engine = _engine(tiny_vlm, temperature=0)
        prompt = engine.tokenizer.prompt_tokens([{"role": "user", "content": text, "images": [RED]}])
        assert red["usage"]["prompt_tokens"] == len(prompt) > len(engine.tokenizer.prompt_tokens(
            [{"role": "user", "content": text}]))
        [expected] = engine._generate_batch([GenerationRequest(token_ids=prompt, episode_id="e", images=[RED])])
        choice = red["choices"][0]
        assert choice["token_ids"] == expected.token_ids
        served = [entry["logprob"] for entry in choice["logprobs"]["content"]]
        assert np.allclose(served, expected.logprobs, atol=1e-5)
        assert not np.allclose(served, [e["logprob"] for e in blue["choices"][0]["logprobs"]["content"]][:len(served)])

        refusals = {
            "no URL is fetched": chat({"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}),
            "holds no image": chat(_image_part(b"not a picture")),
            "only user messages may hold images": chat(after=[
                {"role": "assistant", "content": [_image_part(RED)]}]),
            "unknown content part 'audio'": chat({"type": "audio", "data": ""}),
        }
        for message, reply in refusals.items():
            assert reply.status_code == 400 and message in reply.json()["error"]["message"], (message, reply.text)
    finally:
        httpd.shutdown()
        httpd.server_close()
        server.stop()


@pytest.mark.parametrize("edit_history", [False, True])
async def test_the_gateway_records_a_sessions_images_and_the_learner_scores_them_as_sampled(tiny_vlm, edit_history):
    """An agent's chat session through the training gateway on a vision-language model, an image
    in each user message: each call shows the engine every image its prompt holds, the trajectory
    carries them with their offsets, and the learner's log-probs of the sampled tokens (the whole
    session as one sample, or each turn in its own context after a history break) are the
    engine's."""
    from longhorizon.actor.gateway import ChatRenderer, GatewaySettings, SessionBook, reply_message
    from longhorizon.envs.tool_calls import HermesFormat

    engine = _RecordingEngine(_engine(tiny_vlm, max_new_tokens=3))
    book = SessionBook(GatewaySettings(group_size=1, max_context_tokens=2000, max_new_tokens=3),
                       ChatRenderer(engine.tokenizer, HermesFormat()))
    assert book.renderer.takes_images
    session = book.open("s", "task", horizon_cap=4)

    async def call(messages):
        prompt, continues = book.prompt_for(session, messages, None)
        generation = await engine.generate(GenerationRequest(
            token_ids=prompt, episode_id="s", images=book.prompt_images(session, messages, continues)))
        message, _ = reply_message(book.renderer, generation.text)
        book.record(session, messages, prompt, continues, generation, message, 0.1)
        return message

    messages = [{"role": "user", "content": [{"type": "text", "text": "click the red button"}, _image_part(RED)]}]
    messages.append(await call(messages))
    if edit_history:  # the agent re-wrote its first message: a new segment, every image shown again
        messages[0] = {"role": "user", "content": [{"type": "text", "text": "click the button"}, _image_part(RED)]}
    messages.append({"role": "user", "content": [_image_part(BLUE), {"type": "text", "text": "now blue"}]})
    await call(messages)
    trajectory = decode(encode(book.finish("s", 1.0)))

    assert [request.images for request in engine.requests] == [[RED], [RED, BLUE]]
    image_token = engine.tokenizer.processor.image_token_id
    for request in engine.requests:
        assert request.token_ids.count(image_token) == 4 * len(request.images)
    windows = windows_of(trajectory)
    assert bool(windows) == edit_history
    if edit_history:  # the second segment shows its own copy of the red image
        assert trajectory.images == [RED, RED, BLUE] and trajectory.image_offsets[0] == 0
        assert trajectory.image_offsets[1] == trajectory.image_offsets[2] == windows[1][0]
    else:
        assert trajectory.images == [RED, BLUE] and trajectory.image_offsets[0] == 0 < trajectory.image_offsets[1]
    model, processor = load_causal_lm(tiny_vlm), load_processor(tiny_vlm)
    for request, window in zip(engine.requests, windows):
        assert list(images_of(trajectory, window)) == request.images
    difference = _largest_difference(model, processor, _learner_examples(trajectory),
                                     engine.tokenizer.tokenizer.pad_token_id)
    assert difference < 1e-4, difference


def test_the_gateway_refuses_images_for_a_text_model_and_unreadable_ones_in_one_line(tiny_vlm):
    from longhorizon.actor.gateway import GatewayError, check_messages

    with_image = [{"role": "user", "content": [{"type": "text", "text": "look"}, _image_part(RED)]}]
    with pytest.raises(GatewayError, match="the model takes no images"):
        check_messages(with_image, takes_images=False)
    assert check_messages(with_image, takes_images=True) == with_image
    with pytest.raises(GatewayError, match="holds no image"):
        check_messages([{"role": "user", "content": [_image_part(b"not a picture")]}], takes_images=True)
    with pytest.raises(GatewayError, match="only user messages may hold images"):
        check_messages([{"role": "system", "content": [_image_part(RED)]}], takes_images=True)


def test_the_official_client_sends_an_image_through_the_gateway_into_the_trajectory(tiny_vlm):
    import httpx
    import openai
    from test_gateway import serving

    from longhorizon.actor.gateway import ChatRenderer, GatewaySettings, SessionBook
    from longhorizon.envs.tool_calls import HermesFormat

    engine = _RecordingEngine(_engine(tiny_vlm, max_new_tokens=3))
    book = SessionBook(GatewaySettings(group_size=1, max_context_tokens=2000, max_new_tokens=3),
                       ChatRenderer(engine.tokenizer, HermesFormat()))
    with serving(engine, book) as (url, sent):
        client = openai.OpenAI(base_url=url, api_key="session-1")
        client.chat.completions.create(model="tiny", messages=[
            {"role": "user", "content": [{"type": "text", "text": "click the red button"}, _image_part(RED)]}])
        assert httpx.post(f"{url}/sessions/session-1/reward", json={"reward": 1.0}, timeout=30).status_code == 200
    assert [request.images for request in engine.requests] == [[RED]]
    [trajectory] = sent
    assert trajectory.images == [RED] and trajectory.image_offsets == [0]
