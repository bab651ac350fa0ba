"""Token-in / token-out multi-turn conversations with loss masks.

The actor keeps the exact token ids its model generated; environment observations are appended
as chat-template tokens with loss mask 0. The model's own tokens are never decoded and
re-tokenised, so what the learner trains on is exactly what the actor sampled. For a
vision-language model, observations may carry images: the processor writes their tokens into the
conversation, and the images themselves travel beside the tokens (`HFVisionChatTokenizer`).
"""

from __future__ import annotations

import collections
import functools
import io
import json
import threading
from dataclasses import dataclass, field
from typing import Protocol, Sequence

import numpy as np


def decode_image(data: bytes):
    """An image's bytes (PNG, JPEG: what the env gives) as an RGB PIL image; ValueError in one line
    for bytes that are not an image."""
    from PIL import Image, UnidentifiedImageError

    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ValueError(f"an image must be bytes (PNG or JPEG), got {type(data).__name__}")
    try:
        with Image.open(io.BytesIO(bytes(data))) as image:
            return image.convert("RGB")
    except (UnidentifiedImageError, OSError) as error:
        raise ValueError(f"{len(data)} bytes that are not a readable image: {error}") from None


class ContentError(ValueError):
    """A chat message's content that cannot be read, with a short code for an API's error body."""

    def __init__(self, message: str, code: str = "invalid_content") -> None:
        super().__init__(message)
        self.code = code


def content_parts(content, role: str = "user") -> tuple[str, list[bytes]]:
    """A chat message's content as OpenAI's API sends it, read: (its text, its images). Content is
    a string, None (an assistant message of tool calls only), or a list of parts: text parts,
    joined by newlines, and in user messages `image_url` parts holding a base64 `data:` URL (the
    bytes returned as they are: `decode_image` checks them). Anything else is a `ContentError`."""
    if content is None:
        return "", []
    if isinstance(content, str):
        return content, []
    if not isinstance(content, list) or not all(isinstance(part, dict) for part in content):
        raise ContentError("a message's content must be a string or a list of {type, ...} parts")
    texts, images = [], []
    for part in content:
        kind = part.get("type")
        if kind == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "image_url":
            if role != "user":
                raise ContentError(f"only user messages may hold images, not {role} messages", "unsupported_content")
            images.append(_data_url_bytes(part.get("image_url")))
        else:
            raise ContentError(f"unknown content part {kind!r}: parts are text ({{type, text}}) and image_url",
                               "unsupported_content")
    return "\n".join(texts), images


def check_images(images: Sequence[bytes]) -> None:
    """`ContentError` (code invalid_image) for the first of `images` that is not a readable image."""
    for image in images:
        try:
            decode_image(image)
        except ValueError as error:
            raise ContentError(f"an image_url part holds no image: {error}", "invalid_image") from None


def _data_url_bytes(image_url) -> bytes:
    import base64
    import binascii

    url = image_url.get("url") if isinstance(image_url, dict) else image_url
    if not isinstance(url, str):
        raise ContentError('an image_url part needs {"image_url": {"url": "data:image/png;base64,..."}}')
    head, comma, data = url.partition(",")
    if not (head.startswith("data:image/") and head.endswith(";base64") and comma):
        raise ContentError("an image must come as a data: URL with base64 bytes (data:image/png;base64,...); "
                           "no URL is fetched", "unsupported_content")
    try:
        return base64.b64decode(data, validate=True)
    except binascii.Error as error:
        raise ContentError(f"an image_url part holds no image: {error}", "invalid_image") from None


# What an image processor returns beside the pixels that the model's forward pass does not take.
_IMAGE_PROCESSOR_EXTRAS = ("rows", "cols", "image_sizes_original")


def image_model_inputs(processor, images: list[bytes], dtype=None) -> dict:
    """The model's image inputs (pixel_values and what goes with them) for `images` in the order
    their tokens appear in a batch, row after row: the actor's engine and the learner both build
    them here, so the learner scores the sampled tokens with exactly the pixels they were sampled
    with. `dtype`: the floating tensors' (the model's)."""
    decoded = [decode_image(data) for data in images]
    features = processor.image_processor(images=decoded, return_tensors="pt")
    inputs = {name: value for name, value in features.items() if name not in _IMAGE_PROCESSOR_EXTRAS}
    if dtype is not None:
        inputs = {name: value.to(dtype) if value.is_floating_point() else value for name, value in inputs.items()}
    return inputs


class ChatTokenizer(Protocol):
    """What conversation building needs from a tokenizer."""

    eos_token_id: int

    def prompt_tokens(self, messages: Sequence[dict], tools: Sequence[dict] | None = None) -> list[int]:
        """Tokens of a whole conversation, ending with the prompt for the assistant's turn; `tools`
        (OpenAI function schemas) for the template to render, where `renders_tools` says it can."""

    def continuation_tokens(self, observation: str, *, stopped_on_eos: bool) -> list[int]:
        """Tokens that follow a generated assistant turn: its closing (and the end-of-turn token
        if generation stopped without it), the next user message, and the assistant prompt."""

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of generated tokens, without special tokens."""

    def encode(self, text: str) -> list[int]:
        """Token ids of plain text (no special tokens added)."""


class HFChatTokenizer:
    """A Hugging Face tokenizer with a chat template, adapted to `ChatTokenizer`."""

    # Stand-in texts used to find the template's separators; their content never matters.
    _PROBE_USER = "PROBE_USER_MESSAGE"
    _PROBE_ASSISTANT = "PROBE_ASSISTANT_MESSAGE"
    _PROBE_OBSERVATION = "PROBE_OBSERVATION_TEXT"

    def __init__(self, tokenizer) -> None:
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("the model's tokenizer has no chat template")
        if tokenizer.eos_token_id is None:
            raise ValueError("the model's tokenizer has no end-of-sequence token")
        self.tokenizer = tokenizer
        self.eos_token_id = int(tokenizer.eos_token_id)
        self._after_eos, self._before_observation, self._after_observation = self._template_pieces()
        self._prompts: collections.OrderedDict[str, tuple[int, ...]] = collections.OrderedDict()
        self._prompt_lock = threading.Lock()  # episodes start on several threads

    def _render(self, messages: Sequence[dict], add_generation_prompt: bool, tools: Sequence[dict] | None = None) -> str:
        return self.tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=add_generation_prompt,
            tools=list(tools) if tools else None,
        )

    @functools.cached_property
    def renders_tools(self) -> bool:
        """Whether the chat template shows the tool schemas it is given (Qwen's and Hermes' do,
        SmolLM2's does not): a probe tool's name must appear in the rendering."""
        probe = {"type": "function", "function": {
            "name": "PROBE_TOOL_NAME", "description": "", "parameters": {"type": "object", "properties": {}}}}
        messages = [{"role": "user", "content": self._PROBE_USER}]
        try:
            return "PROBE_TOOL_NAME" in self._render(messages, add_generation_prompt=True, tools=[probe])
        except Exception:  # a template that fails on `tools` renders none
            return False

    def _template_pieces(self) -> tuple[str, str, str]:
        """Split the template around one user turn that follows an assistant turn.

        Rendering [user, assistant] and [user, assistant, user(obs)] and diffing them gives the
        text between the assistant's end-of-turn token and the observation, and the text after
        the observation up to the next assistant turn.
        """
        eos = self.tokenizer.eos_token
        base = [
            {"role": "user", "content": self._PROBE_USER},
            {"role": "assistant", "content": self._PROBE_ASSISTANT},
        ]
        closed = self._render(base, add_generation_prompt=False)
        extended = self._render(
            base + [{"role": "user", "content": self._PROBE_OBSERVATION}], add_generation_prompt=True
        )
        if not extended.startswith(closed) or eos not in closed[closed.rindex(self._PROBE_ASSISTANT):]:
            raise ValueError("unsupported chat template: a later turn changes the rendering of earlier ones")
        after_eos = closed[closed.rindex(eos) + len(eos):]
        new_turn = extended[len(closed):]
        before, after = new_turn.split(self._PROBE_OBSERVATION, 1)
        return after_eos, before, after

    PROMPT_MEMORY = 256
    """Prompts whose tokens are kept: the members of a group start from the same prompt, and a
    chat template's rendering (Jinja, then the tokenizer) was 9% of an actor's CPU on codebook."""

    def prompt_tokens(self, messages: Sequence[dict], tools: Sequence[dict] | None = None) -> list[int]:
        if tools and not self.renders_tools:
            raise ValueError("the model's chat template renders no tools: describe them in a message instead")
        try:
            key = json.dumps([messages, tools], sort_keys=True)
        except (TypeError, ValueError):  # a value JSON cannot spell: rendered every time
            key = None
        with self._prompt_lock:
            ids = self._prompts.get(key) if key is not None else None
            if ids is not None:
                self._prompts.move_to_end(key)
                return list(ids)
        ids = [int(i) for i in self.tokenizer.apply_chat_template(
            list(messages), tokenize=True, add_generation_prompt=True, return_dict=False,
            tools=list(tools) if tools else None,
        )]
        if key is not None:
            with self._prompt_lock:
                self._prompts[key] = tuple(ids)
                while len(self._prompts) > self.PROMPT_MEMORY:
                    self._prompts.popitem(last=False)
        return ids

    def continuation_tokens(self, observation: str, *, stopped_on_eos: bool) -> list[int]:
        text = self._after_eos + self._before_observation + observation + self._after_observation
        ids = self.encode(text)
        return ids if stopped_on_eos else [self.eos_token_id] + ids

    def encode(self, text: str) -> list[int]:
        return [int(i) for i in self.tokenizer.encode(text, add_special_tokens=False)]

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)


class HFVisionChatTokenizer(HFChatTokenizer):
    """A vision-language model's processor adapted to `ChatTokenizer`: a user message may carry
    images (`message["images"]`, PNG or JPEG bytes, shown before its text), which the chat template
    writes as the processor's image placeholder and the processor expands into the model's image
    tokens. The tokens stay the conversation's record; the images travel beside them, in order."""

    takes_images = True

    def __init__(self, processor) -> None:
        tokenizer = processor.tokenizer
        if getattr(tokenizer, "chat_template", None) is None:
            # A VLM folder often keeps its chat template with the processor alone.
            tokenizer.chat_template = getattr(processor, "chat_template", None)
        self.processor = processor
        super().__init__(tokenizer)

    @staticmethod
    def _as_parts(messages: Sequence[dict]) -> list[dict]:
        """Messages with content as a list of parts (images first, then the text), the form VLM
        chat templates expect."""
        parted = []
        for message in messages:
            content = message["content"]
            if isinstance(content, str):
                content = [{"type": "image"} for _ in message.get("images", ())] + [{"type": "text", "text": content}]
            parted.append({"role": message["role"], "content": content})
        return parted

    def _render(self, messages: Sequence[dict], add_generation_prompt: bool, tools: Sequence[dict] | None = None) -> str:
        return super()._render(self._as_parts(messages), add_generation_prompt, tools)

    def _tokens(self, text: str, images: Sequence[bytes]) -> list[int]:
        pictures = [decode_image(data) for data in images]
        encoded = self.processor(text=[text], images=[pictures] if pictures else None, add_special_tokens=False)
        return [int(i) for i in encoded["input_ids"][0]]

    def prompt_tokens(self, messages: Sequence[dict], tools: Sequence[dict] | None = None) -> list[int]:
        if tools and not self.renders_tools:
            raise ValueError("the model's chat template renders no tools: describe them in a message instead")
        images = [image for message in messages for image in message.get("images", ())]
        return self._tokens(self._render(messages, add_generation_prompt=True, tools=tools), images)

    def continuation_tokens(self, observation: str, *, stopped_on_eos: bool, images: Sequence[bytes] = ()) -> list[int]:
        if not images:
            return super().continuation_tokens(observation, stopped_on_eos=stopped_on_eos)
        # The observation's turn as the template writes it with its images, found as the text
        # pieces are: the rendering of one more user turn after a closed assistant turn.
        base = [{"role": "user", "content": self._PROBE_USER}, {"role": "assistant", "content": self._PROBE_ASSISTANT}]
        closed = self._render(base, add_generation_prompt=False)
        extended = self._render(
            base + [{"role": "user", "content": observation, "images": list(images)}], add_generation_prompt=True)
        ids = self._tokens(self._after_eos + extended[len(closed):], images)
        return ids if stopped_on_eos else [self.eos_token_id] + ids

    def folded_images(self, token_ids: Sequence[int], images: Sequence[bytes]) -> list[int]:
        """`token_ids` with each image's tokens, as the processor writes them, folded back into the
        processor's one placeholder token: the form an engine that writes the image tokens itself
        takes (vLLM). ValueError when an image's tokens are not there, in order."""
        placeholder_text = getattr(self.processor, "image_token", None) or "<image>"
        placeholder = self.tokenizer.convert_tokens_to_ids(placeholder_text)
        tokens = list(token_ids)
        folded: list[int] = []
        start = 0
        for number, image in enumerate(images, 1):
            span = self._tokens(placeholder_text, [image])
            at = next((index for index in range(start, len(tokens) - len(span) + 1)
                       if tokens[index:index + len(span)] == span), -1)
            if at < 0:
                raise ValueError(f"image {number} of {len(images)}: its {len(span)} tokens are not in the prompt")
            folded += tokens[start:at] + [placeholder]
            start = at + len(span)
        return folded + tokens[start:]

    def image_inputs(self, images: Sequence[bytes], dtype=None) -> dict:
        """The model's image inputs for `images` (common.models.image_model_inputs)."""
        return image_model_inputs(self.processor, list(images), dtype)


def takes_images(tokenizer) -> bool:
    """Whether a chat tokenizer can put images in a conversation (a VLM's processor)."""
    return bool(getattr(tokenizer, "takes_images", False))


NO_IMAGE_PROCESSOR = ("the model cannot be shown images: its folder has no image processor "
                      "(use a vision-language model's folder, with its processor files)")


class ByteChatTokenizer:
    """UTF-8 bytes as tokens plus three specials: no model needed (scripted engines, benchmarks)."""

    IM_START = 256
    IM_END = 257
    PAD = 258
    vocab_size = 259

    def __init__(self) -> None:
        self.eos_token_id = self.IM_END

    def _turn(self, role: str, content: str) -> list[int]:
        return [self.IM_START, *f"{role}\n{content}".encode(), self.IM_END, *b"\n"]

    renders_tools = False

    def prompt_tokens(self, messages: Sequence[dict], tools: Sequence[dict] | None = None) -> list[int]:
        if tools:
            raise ValueError("the byte tokenizer renders no tools: describe them in a message instead")
        ids: list[int] = []
        for message in messages:
            ids += self._turn(message["role"], message["content"])
        return ids + [self.IM_START, *b"assistant\n"]

    def continuation_tokens(self, observation: str, *, stopped_on_eos: bool) -> list[int]:
        ids = [*b"\n"] + self._turn("user", observation) + [self.IM_START, *b"assistant\n"]
        return ids if stopped_on_eos else [self.IM_END] + ids

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, token_ids: Sequence[int]) -> str:
        return bytes(t for t in token_ids if t < 256).decode(errors="replace")


@dataclass(frozen=True)
class ConversationView:
    """What the model is shown for its next turn: pieces of a TokenConversation, as tokens and as
    the same messages. Views only select whole pieces, so the model's own tokens are never
    re-tokenised. The lists may be the conversation's own: read them before it grows."""

    token_ids: list[int]
    messages: list[dict]
    window_start: int = 0
    """Where, in the conversation's tokens, the turns shown begin after the first prompt: at or
    before the prompt's end the view is the whole history; past it, the turns before were left
    out (the view is the first prompt joined to token_ids[window_start:])."""
    images: list[bytes] = field(default_factory=list)
    """The images in token_ids, in the order their tokens appear (a vision-language model's)."""


@dataclass(kw_only=True)
class TokenRecord:
    """Tokens as a trajectory carries them: each id, whether the model generated it (the loss
    mask), and for a generated one its behaviour log-prob and the weights version that wrote it
    (0.0 and -1 for the others)."""

    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    behaviour_logprobs: list[float] = field(default_factory=list)
    policy_versions: list[int] = field(default_factory=list)

    def append_tokens(
        self,
        token_ids: Sequence[int],
        *,
        generated: bool,
        logprobs: Sequence[float] | None = None,
        policy_version: int = -1,
    ) -> None:
        count = len(token_ids)
        self.token_ids.extend(int(t) for t in token_ids)
        self.loss_mask.extend([1 if generated else 0] * count)
        if generated:
            if logprobs is None or len(logprobs) != count:
                raise ValueError("generated tokens need one behaviour log-prob each")
            self.behaviour_logprobs.extend(float(lp) for lp in logprobs)
            self.policy_versions.extend([policy_version] * count)
        else:
            self.behaviour_logprobs.extend([0.0] * count)
            self.policy_versions.extend([-1] * count)


@dataclass(kw_only=True)
class TokenConversation(TokenRecord):
    """A conversation held as tokens (what the model saw and wrote) and as messages (for text).

    Laid out as the first prompt, then one piece per turn: the model's reply followed by the
    template tokens of the observation after it, ending with the next assistant prompt.
    """

    tokenizer: ChatTokenizer
    messages: list[dict]
    prompt_length: int = 0
    prompt_messages: int = 0
    """Messages in the first prompt (system and first observation)."""
    turn_starts: list[int] = field(default_factory=list)
    """Where each turn (a reply and the observation after it) begins in token_ids."""
    images: list[bytes] = field(default_factory=list)
    """Images shown to the model, in the order of their tokens (for a vision-language model)."""
    image_offsets: list[int] = field(default_factory=list)
    """Where the piece that holds each image begins in token_ids (0: the first prompt; else the
    observation's piece after a reply), so a view or a turn's sample keeps the images of the
    pieces it keeps."""

    @classmethod
    def start(cls, tokenizer: ChatTokenizer, messages: Sequence[dict],
              tools: Sequence[dict] | None = None) -> "TokenConversation":
        """The first prompt; `tools` are rendered by the chat template (tokenizers that take none
        are called without them)."""
        prompt_images = [image for message in messages for image in message.get("images", ())]
        if prompt_images and not takes_images(tokenizer):
            raise ValueError(NO_IMAGE_PROCESSOR)
        conversation = cls(tokenizer=tokenizer, messages=[dict(m) for m in messages])
        conversation.images = list(prompt_images)
        conversation.image_offsets = [0] * len(prompt_images)
        prompt = tokenizer.prompt_tokens(messages, tools=tools) if tools else tokenizer.prompt_tokens(messages)
        conversation.append_tokens(prompt, generated=False)
        conversation.prompt_length = len(conversation.token_ids)
        conversation.prompt_messages = len(conversation.messages)
        return conversation

    def add_generation(
        self, token_ids: Sequence[int], logprobs: Sequence[float], policy_version: int, text: str
    ) -> None:
        """Append the model's turn exactly as sampled, tagged with the weights version that wrote it."""
        self.turn_starts.append(len(self.token_ids))
        self.append_tokens(token_ids, generated=True, logprobs=logprobs, policy_version=policy_version)
        self.messages.append({"role": "assistant", "content": text})

    def add_observation(self, observation: str, *, stopped_on_eos: bool, images: Sequence[bytes] = ()) -> None:
        """Append the environment's reply as template tokens (never trained on), with `images`
        (PNG or JPEG bytes: a screenshot) shown before its text."""
        if not images:
            self.append_tokens(self.tokenizer.continuation_tokens(observation, stopped_on_eos=stopped_on_eos),
                               generated=False)
            self.messages.append({"role": "user", "content": observation})
            return
        if not takes_images(self.tokenizer):
            raise ValueError(NO_IMAGE_PROCESSOR)
        piece_start = len(self.token_ids)
        tokens = self.tokenizer.continuation_tokens(observation, stopped_on_eos=stopped_on_eos, images=images)
        self.append_tokens(tokens, generated=False)
        self.messages.append({"role": "user", "content": observation, "images": list(images)})
        self.images.extend(images)
        self.image_offsets.extend([piece_start] * len(images))

    def __len__(self) -> int:
        return len(self.token_ids)

    def full_view(self) -> ConversationView:
        """Everything so far: what the model sees by default."""
        return ConversationView(self.token_ids, self.messages, self.prompt_length, list(self.images))

    def last_turns_view(self, turns: int) -> ConversationView:
        """The first prompt and only the last `turns` turns (older replies and observations left
        out). Each kept piece already starts where an assistant prompt ends, so joining them
        gives a well-formed conversation without tokenising anything again."""
        if turns < 1:
            raise ValueError(f"a view keeps at least the last turn (it holds the latest observation), got {turns}")
        first_kept = max(0, len(self.turn_starts) - turns)
        if first_kept == 0:
            return self.full_view()
        token_ids = self.token_ids[: self.prompt_length] + self.token_ids[self.turn_starts[first_kept]:]
        # Every turn before the kept ones is complete: its reply and its observation.
        messages = self.messages[: self.prompt_messages] + self.messages[self.prompt_messages + 2 * first_kept:]
        window_start = self.turn_starts[first_kept]
        return ConversationView(token_ids, messages, window_start,
                                self.images_between(self.prompt_length, window_start, len(self.token_ids)))

    def images_between(self, prompt_length: int, start: int, end: int) -> list[bytes]:
        """The images of the first prompt and of the pieces in [start, end): those of a view, or of
        a turn's sample, that joins the first prompt to token_ids[start:end]."""
        return [image for image, offset in zip(self.images, self.image_offsets)
                if offset < prompt_length or start <= offset < end]

    def arrays(self) -> dict[str, np.ndarray]:
        return {
            "token_ids": np.asarray(self.token_ids, dtype=np.int32),
            "loss_mask": np.asarray(self.loss_mask, dtype=np.uint8),
            "behaviour_logprobs": np.asarray(self.behaviour_logprobs, dtype=np.float32),
            "policy_versions": np.asarray(self.policy_versions, dtype=np.int32),
        }

    def text(self) -> str:
        """The episode as readable text, one block per message."""
        return "\n\n".join(f"[{m['role']}]\n{m['content']}" for m in self.messages)
