"""A tiny randomly initialised vision-language model (Idefics3, the SmolVLM architecture) for tests.

Built from a config with tiny sizes and a word-level tokenizer, with its processor (image
processor, tokenizer, chat template) assembled here and everything saved with save_pretrained, so
that a test points `model.path` at the folder as a user would at a downloaded SmolVLM. No network.
"""

from __future__ import annotations

import io
from pathlib import Path

from longhorizon.common.models import TINY_ROLE_WORDS, word_level_tokenizer

VLM_WORDS = ["click", "type", "submit", "page", "button", "red", "blue", "green", "the", "a", "done"]

# Idefics3's image tokens: the processor writes each image as <fake_token_around_image><global-img>,
# then image_seq_len <image> tokens, then <fake_token_around_image> again.
VLM_SPECIAL_TOKENS = ["<pad>", "<unk>", "<|im_start|>", "<end_of_utterance>", "<fake_token_around_image>",
                      "<global-img>", "<image>"]

# ChatML-shaped and space separated, as the tiny text models' template; a message's content may be
# a list of parts, an image part written as the processor's <image> placeholder.
VLM_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|> {{ message['role'] }} "
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<image>{% else %}{{ part['text'] }}{% endif %} "
    "{% endfor %}{% endif %} <end_of_utterance> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)

IMAGE_SIDE = 32
"""Every image is resized to this side (one 32x32 picture, no splitting): 4 patches of 8 pixels a
side per row, merged 2x2, so each image is 4 <image> tokens (plus its 3 framing tokens)."""


def build_tiny_vlm(folder: str | Path, *, seed: int = 0, words: list[str] = VLM_WORDS, text_heads: int = 4) -> Path:
    """Write a randomly initialised tiny Idefics3 model and its processor to `folder` (`text_heads`
    attention heads over the text model's 64 dimensions: 1 for vLLM, whose CPU attention has no
    kernel for heads of 16)."""
    import torch
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration, Idefics3ImageProcessor, Idefics3Processor

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer, vocab = word_level_tokenizer(
        VLM_SPECIAL_TOKENS + TINY_ROLE_WORDS + list(words), eos_token="<end_of_utterance>",
        special_tokens=["<|im_start|>", "<fake_token_around_image>", "<global-img>", "<image>"])
    tokenizer.chat_template = VLM_CHAT_TEMPLATE
    image_processor = Idefics3ImageProcessor(
        do_resize=True, size={"longest_edge": IMAGE_SIDE}, max_image_size={"longest_edge": IMAGE_SIDE},
        do_image_splitting=False,
    )
    processor = Idefics3Processor(image_processor=image_processor, tokenizer=tokenizer, image_seq_len=4,
                                  chat_template=VLM_CHAT_TEMPLATE)
    processor.save_pretrained(folder)

    config = Idefics3Config(
        vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                       "num_attention_heads": 2, "image_size": IMAGE_SIDE, "patch_size": 8},
        text_config={"model_type": "llama", "vocab_size": len(vocab), "hidden_size": 64,
                     "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": text_heads,
                     "num_key_value_heads": text_heads, "max_position_embeddings": 1024,
                     "pad_token_id": vocab["<pad>"], "eos_token_id": vocab["<end_of_utterance>"],
                     "bos_token_id": None, "tie_word_embeddings": False},
        scale_factor=2,
        image_token_id=vocab["<image>"],
        pad_token_id=vocab["<pad>"],
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = Idefics3ForConditionalGeneration(config)
    model.generation_config.eos_token_id = vocab["<end_of_utterance>"]
    model.generation_config.pad_token_id = vocab["<pad>"]
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def png_image(colour: tuple[int, int, int], size: tuple[int, int] = (40, 24)) -> bytes:
    """A PNG of one colour with a lighter square in a corner: a stand-in for a screenshot."""
    from PIL import Image

    image = Image.new("RGB", size, colour)
    image.paste(tuple(min(255, c + 90) for c in colour), (0, 0, size[0] // 3, size[1] // 3))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


# -- a toy env with a screen: the colour shown is the answer -------------------------------------

COLOURS = {"red": (200, 20, 20), "blue": (20, 20, 200), "green": (20, 160, 40)}


class ColourScreenEnv:
    """Each step shows a screen of one colour (info["screenshot"], and the same image as "som", as
    the web env gives them); the reply that names the colour earns 1. The text never names it, so
    only a policy that sees the image can do better than chance."""

    name = "colour_screens"
    prompt_format = "bare"

    def __init__(self, *, turns: int = 2) -> None:
        self.turns = turns
        self.colours: list[str] = []
        self.step_count = 0

    def instructions(self) -> str:
        return "the page"

    def _info(self, success: bool = False) -> dict:
        screen = png_image(COLOURS[self.colours[min(self.step_count, len(self.colours) - 1)]])
        return {"screenshot": screen, "som": screen, "success": success}

    async def reset(self, task, *, seed=None):
        self.colours, self.step_count = list(task.data["colours"]), 0
        return "click the button", self._info()

    async def step(self, action):
        reward = 1.0 if action.split()[0] == self.colours[self.step_count] else 0.0
        self.step_count += 1
        done = self.step_count >= self.turns
        return "click the button", reward, done, False, self._info(success=done)

    async def close(self):
        pass


def colour_tasks(split: str, *, turns: int = 2):
    from longhorizon.envs.base import Task

    names = sorted(COLOURS)
    return [Task(env_name="colour_screens", task_id=f"{split}-{index}", split=split,
                 data={"colours": [names[(index + turn) % len(names)] for turn in range(turns)]})
            for index in range(6)]


def _colour_spec():
    from longhorizon.envs.base import EnvSpec

    return EnvSpec(name="colour_screens", factory=ColourScreenEnv, tasks=colour_tasks)


COLOUR_SPEC = _colour_spec()
"""`env.name = "vlm_models:COLOUR_SPEC"` (with tests/ on the Python path)."""
