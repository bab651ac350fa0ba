"""LoRA (`learner.lora`): only low-rank adapters train, and only they travel to the actors.

The learner wraps its model with peft's LoRA layers on the modules `target_modules` names (a
module matches when its name ends with one of them, as peft matches). The base weights stay
frozen; the optimiser holds the adapters alone. Actors hold the same base model and receive the
adapters' tensors only (a few MB instead of the whole model); an engine checks a whole update
(names, shapes against the base layers, dtypes, finite values) before it copies any tensor and
refuses one that does not fit, so an update never half-arrives. Checkpoints export the merged model
(base plus adapters) as a plain Hugging Face folder for eval and for users.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from longhorizon.common.models import check_weights, tensor_specs

LORA_KEYS = ("rank", "alpha", "target_modules", "dropout")


class LoraError(ValueError):
    """`learner.lora` is not a usable LoRA setting."""


@dataclass(frozen=True)
class LoraSettings:
    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    dropout: float = 0.0

    @property
    def scale(self) -> float:
        """The factor on the adapters' product: W' = W + (alpha / rank) B A (peft's scaling)."""
        return self.alpha / self.rank

    def as_table(self) -> dict:
        return {"rank": self.rank, "alpha": self.alpha, "target_modules": list(self.target_modules),
                "dropout": self.dropout}


def lora_settings(table: dict | None) -> LoraSettings | None:
    """The settings a `learner.lora` table gives, or None for an empty table (full fine-tuning)."""
    if not table:
        return None
    unknown = sorted(set(table) - set(LORA_KEYS))
    if unknown:
        raise LoraError(f"unknown key learner.lora.{unknown[0]}; valid: {', '.join(LORA_KEYS)}")
    rank, targets = table.get("rank"), table.get("target_modules")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise LoraError(f"learner.lora.rank must be a positive integer, got {rank!r}")
    alpha = table.get("alpha", 2 * rank)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or alpha <= 0:
        raise LoraError(f"learner.lora.alpha must be a positive number, got {alpha!r}")
    if isinstance(targets, str):
        targets = [targets]
    if not targets or not all(isinstance(t, str) and t for t in targets):
        raise LoraError(
            "learner.lora.target_modules must list module names to adapt, e.g. "
            '["q_proj", "k_proj", "v_proj", "o_proj"]'
        )
    dropout = table.get("dropout", 0.0)
    if not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
        raise LoraError(f"learner.lora.dropout must be in [0, 1), got {dropout!r}")
    return LoraSettings(rank=rank, alpha=float(alpha), target_modules=tuple(targets), dropout=float(dropout))


def matches_target(module_name: str, targets) -> bool:
    """Whether a module is adapted: its name is a target or ends with one (as peft matches)."""
    return any(module_name == target or module_name.endswith("." + target) for target in targets)


def linear_module_names(model) -> list[str]:
    import torch

    return [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]


def check_targets(settings: LoraSettings, module_names: list[str]) -> None:
    """Every target must match at least one linear module (by name suffix, as peft matches)."""
    for target in settings.target_modules:
        if not any(matches_target(name, [target]) for name in module_names):
            suffixes = sorted({name.rsplit(".", 1)[-1] for name in module_names})
            raise LoraError(
                f"learner.lora.target_modules: {target!r} matches no linear module of the model; "
                f"its linear modules are named {', '.join(suffixes)}"
            )


def check_targets_of_model_folder(settings: LoraSettings, folder) -> None:
    """`check_targets` against a model folder without loading its weights (before any process
    starts): the architecture is built on the meta device."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    check_targets(settings, linear_module_names(model))
    output = model.get_output_embeddings()
    output_name = next((name for name, module in model.named_modules() if module is output), None)
    if output_name and getattr(config, "tie_word_embeddings", False):
        for target in settings.target_modules:
            if matches_target(output_name, [target]):
                # The merged update would land on a matrix the model folder stores only as the
                # input embedding: an export or an engine's merge could not place it.
                raise LoraError(
                    f"learner.lora.target_modules: {target!r} is this model's output layer, which is tied to "
                    f"its input embedding; LoRA cannot adapt a tied output layer: leave {target!r} out"
                )


def apply_lora(model, settings: LoraSettings):
    """The model with LoRA adapters on its target modules; only the adapters require gradients.
    The adapters start as a zero update (B = 0), so the wrapped model computes what the base does."""
    from peft import LoraConfig, get_peft_model

    check_targets(settings, linear_module_names(model))
    return get_peft_model(model, LoraConfig(
        r=settings.rank, lora_alpha=settings.alpha, target_modules=list(settings.target_modules),
        lora_dropout=settings.dropout, bias="none",
    ))


def adapter_state_dict(model) -> dict:
    """The adapters' A and B tensors, detached, named as peft names them in a saved adapter. Only
    those: peft's own saved state also carries the frozen base weight of an adapted output layer,
    which would travel with every update for nothing."""
    return {saved: tensor.detach() for name, tensor in model.named_parameters()
            if (saved := adapter_name(name)) is not None}


LORA_HINT = "learner and actor must use the same learner.lora"


def check_adapters_for(model, tensors: dict) -> None:
    """Raise `WeightsRefused` unless `tensors` hold exactly the LoRA-wrapped model's adapters, each
    of its shape (set by its base layer and the rank), a float dtype and finite values."""
    check_weights(tensors, tensor_specs(adapter_state_dict(model)), subject="adapter update", hint=LORA_HINT)


def load_adapters(model, tensors: dict, *, checked: bool = False) -> None:
    """Copy received adapter tensors into a LoRA-wrapped model, all or nothing: the whole set is
    checked first (`check_adapters_for`; `checked=True` when the caller just did), so a refused
    update leaves every adapter as it was."""
    from peft import set_peft_model_state_dict

    if not checked:
        check_adapters_for(model, tensors)
    result = set_peft_model_state_dict(model, tensors)
    if getattr(result, "unexpected_keys", None):
        raise ValueError(f"adapter tensors not placed: {sorted(result.unexpected_keys)[:3]}")


def adapter_specs(base: dict, rank: int) -> dict:
    """Name -> (shape, dtype) of the adapters an update must hold for the modules of `base`
    (module name -> its weight W, out x in), as peft shapes them: A is rank x in, B is out x rank.
    What an engine that merges adapters into base weights checks an update against."""
    specs = {}
    for module, weight in base.items():
        out_features, in_features = weight.shape
        specs[f"{ADAPTER_PREFIX}{module}.lora_A.weight"] = ((rank, in_features), weight.dtype)
        specs[f"{ADAPTER_PREFIX}{module}.lora_B.weight"] = ((out_features, rank), weight.dtype)
    return specs


ADAPTER_PREFIX = "base_model.model."


def _adapter_parts(name: str) -> tuple[str, str]:
    """'base_model.model.<module>.lora_A.weight' -> ('<module>', 'A'), as peft names saved adapters."""
    for part in ("A", "B"):
        suffix = f".lora_{part}.weight"
        if name.startswith(ADAPTER_PREFIX) and name.endswith(suffix):
            return name[len(ADAPTER_PREFIX):-len(suffix)], part
    raise ValueError(f"{name!r} is not a LoRA adapter tensor ({ADAPTER_PREFIX}<module>.lora_A/B.weight)")


def target_weights_of_model_folder(settings: LoraSettings, folder) -> dict:
    """Module name -> weight matrix of every module the settings adapt, read from a model folder's
    safetensors files: what an engine that merges adapters adds them to."""
    from safetensors import safe_open

    weights = {}
    for file in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                module = name.removesuffix(".weight")
                if module != name and matches_target(module, settings.target_modules):
                    tensor = handle.get_tensor(name)
                    if tensor.ndim == 2:
                        weights[module] = tensor
    if not weights:
        raise LoraError(f"learner.lora.target_modules {list(settings.target_modules)} name no weight matrix "
                        f"stored in {folder}")
    return weights


def merge_adapters(base: dict, adapters: dict, scale: float) -> dict:
    """W + scale * B A in fp32 for every module of `base` (module name -> W), under the model's
    own tensor names (`<module>.weight`). The adapters must hold an A and a B for exactly those
    modules: an update that does not fit the engine's model is refused whole, never half-applied."""
    import torch

    pairs: dict[str, dict] = {}
    for name, tensor in adapters.items():
        module, part = _adapter_parts(name)
        pairs.setdefault(module, {})[part] = torch.as_tensor(tensor)
    missing, unexpected = sorted(set(base) - set(pairs)), sorted(set(pairs) - set(base))
    incomplete = sorted(module for module, parts in pairs.items() if set(parts) != {"A", "B"})
    if missing or unexpected or incomplete:
        raise ValueError(
            f"adapter update does not match the engine's LoRA targets: missing {missing[:3]}, unexpected "
            f"{unexpected[:3]}, without both A and B {incomplete[:3]} (learner and actor must use the same "
            f"learner.lora)"
        )
    merged = {}
    with torch.no_grad():
        for module, weight in base.items():
            a, b = pairs[module]["A"].float(), pairs[module]["B"].float()
            if b.shape[0] != weight.shape[0] or a.shape[1] != weight.shape[1] or a.shape[0] != b.shape[1]:
                raise ValueError(f"adapter shapes A {tuple(a.shape)}, B {tuple(b.shape)} do not fit "
                                 f"{module}.weight {tuple(weight.shape)}")
            merged[f"{module}.weight"] = (weight.float() + scale * (b @ a)).contiguous()
    return merged


def adapter_name(parameter_name: str, adapter: str = "default") -> str | None:
    """The saved-adapter name of a LoRA parameter of a peft model ('...q_proj.lora_A.default.weight'
    -> '...q_proj.lora_A.weight', as `adapter_state_dict` names it), or None for any other."""
    for part in ("lora_A", "lora_B"):
        marker = f".{part}.{adapter}."
        if marker in parameter_name:
            return parameter_name.replace(marker, f".{part}.")
    return None


def merged_from_peft_state(state: dict, scale: float) -> dict:
    """A peft model's full state dict (names as the PeftModel has them) as a plain model's: base
    weights under their own names, with scale * B A added where there are adapters."""
    prefix = ADAPTER_PREFIX
    base, adapters, plain = {}, {}, {}
    for name, tensor in state.items():
        saved = adapter_name(name)
        if saved is not None:
            adapters[saved] = tensor
        elif name.endswith(".base_layer.weight"):
            base[name[len(prefix):-len(".base_layer.weight")]] = tensor
        else:
            plain[name[len(prefix):].replace(".base_layer.", ".")] = tensor
    merged = merge_adapters(base, adapters, scale)
    return {**plain, **{name: merged[name].to(base[name.removesuffix(".weight")].dtype) for name in merged}}
