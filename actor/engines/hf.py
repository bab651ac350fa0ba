"""The `hf` engine: transformers generation on CPU or GPU, batched across concurrent episodes.

Episodes call `generate` independently; requests that arrive while a batch is running are
collected and run together in the next batch (left-padded), so many episodes in flight share one
forward pass per token. The model runs in a worker thread so the actor's trio loop keeps
stepping environments and talking to the learner meanwhile. New weights (from tensors, a folder,
or received over a collective while generation goes on) are checked whole, then swapped in under
the model lock, between batches, so no turn mixes two versions; an update that does not fit is
refused before any tensor is copied. A vision-language model's folder (model.path) brings its
processor: requests may then carry images, which each batch turns into the model's pixel inputs.
"""

from __future__ import annotations

import logging
import math
import threading
from dataclasses import dataclass, field
from typing import Any

import trio

from longhorizon.actor.engines.base import (
    EngineCapabilities,
    EngineSettings,
    GenerationRequest,
    GenerationResult,
    engine_options,
    tokens_through_stop_string,
)
from longhorizon.common.chat import NO_IMAGE_PROCESSOR, HFChatTokenizer, HFVisionChatTokenizer, takes_images
from longhorizon.common.config import Section
from longhorizon.common.models import (
    check_state_for, image_token_ids, is_vision_language_folder, load_causal_lm, load_processor, load_state_into,
    load_tokenizer, resolve_device,
)
from longhorizon.common.lora import apply_lora, lora_settings, check_adapters_for, load_adapters
from longhorizon.actor.weights import WeightsReceiver

log = logging.getLogger(__name__)


@dataclass
class _Slot:
    request: GenerationRequest
    wake: trio.Event = field(default_factory=trio.Event)
    result: GenerationResult | None = None
    error: BaseException | None = None


@dataclass
class ResultWithTopLogprobs(GenerationResult):
    """A GenerationResult that also holds, for each sampled token, the most likely tokens of the
    distribution it was drawn from: `top_logprobs[i]` is [(token_id, log-prob), ...], most likely
    first. Tokens the sampler could not draw (cut by top-p) are left out, so a list may be short."""

    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)


class HFOptions(Section):
    """The hf engine's keys of `actor.engine_options`."""

    device: str = "auto"
    """Where the model runs: auto (a CUDA GPU when present, else the CPU), cpu, cuda or cuda:N."""


class HFEngine:
    """Token-in / token-out generation with per-token log-probs using transformers."""

    capabilities = EngineCapabilities(takes_lora=True, weight_transports=("inline", "path", "collective"),
                                      takes_images=True)
    Options = HFOptions

    def __init__(self, settings: EngineSettings) -> None:
        import torch


        self.device = resolve_device(engine_options(HFEngine, settings.engine_options).device)
        torch.set_num_threads(max(1, settings.torch_threads))
        # transformers samples from torch's global generator.
        torch.manual_seed(settings.seed)
        self.settings = settings
        self.sampling = settings.sampling
        self.model = load_causal_lm(settings.model_path, settings.dtype).to(self.device).eval()

        # With learner.lora the updates are adapters: the model gets the learner's LoRA layers
        # (a zero update until the first weights arrive).
        self.lora = lora_settings(settings.lora)
        if self.lora is not None:
            self.model = apply_lora(self.model, self.lora).eval()
        # A vision-language model's folder brings its processor: its conversations may hold images.
        processor = load_processor(settings.model_path) if is_vision_language_folder(settings.model_path) else None
        self.tokenizer = (HFVisionChatTokenizer(processor) if processor is not None
                          else HFChatTokenizer(load_tokenizer(settings.model_path)))
        # An image token written by the policy would have no image behind it: never sampled.
        self.suppressed_tokens = list(image_token_ids(self.model.config))
        self.pad_token_id = self.tokenizer.tokenizer.pad_token_id
        if self.pad_token_id is None:
            self.pad_token_id = self.tokenizer.eos_token_id
        self.policy_version = 0
        self.max_batch_size = max(1, settings.max_batch_size)
        self._model_lock = threading.Lock()

        self._weights = WeightsReceiver(self.device)  # every transport's end in this process
        self._pending: list[_Slot] = []
        self._busy = False

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        slot = _Slot(request)
        self._pending.append(slot)
        while slot.result is None and slot.error is None:
            if self._busy:
                await slot.wake.wait()
                slot.wake = trio.Event()
                continue
            # Lead one batch: whoever finds the engine idle runs the next batch for everyone.
            self._busy = True
            try:
                await trio.sleep(0)  # let episodes that are ready in this tick join the batch
                batch = self._pending[: self.max_batch_size]
                del self._pending[: len(batch)]
                try:
                    results = await trio.to_thread.run_sync(
                        self._generate_batch, [s.request for s in batch]
                    )
                    for batch_slot, result in zip(batch, results):
                        batch_slot.result = result
                except Exception as exc:  # every waiting episode learns of the failure
                    for batch_slot in batch:
                        batch_slot.error = exc
                for batch_slot in batch:
                    batch_slot.wake.set()
            finally:
                self._busy = False
                if self._pending:
                    self._pending[0].wake.set()  # hand leadership to the next waiting request
        if slot.error is not None:
            raise slot.error
        return slot.result

    def _generate_batch(
        self, requests: list[GenerationRequest], top_logprobs: int = 0, on_step=None, cancelled=None,
    ) -> list[GenerationResult]:
        """Generate one reply per request in one batch. With `top_logprobs` > 0 the results are
        `ResultWithTopLogprobs` holding that many most likely tokens at each sampled position.
        `on_step(tokens, logprobs, tops)`, when given, is called after every decoding step with
        each row's new token, its log-prob and its top list (as in `ResultWithTopLogprobs`):
        a server can send tokens while the batch is still generating. Rows that have finished
        get padding tokens, which the caller ignores. `cancelled()`, when given, is asked after
        every step: once true, every row ends there (its reply cut short); it may also answer a
        bool per row, ending only the rows it names (a server whose client left)."""
        import torch
        from transformers import GenerationConfig, StoppingCriteriaList

        sampling = self.sampling
        longest = max(len(r.token_ids) for r in requests)
        input_ids = torch.full((len(requests), longest), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(requests), longest), dtype=torch.long)
        for row, request in enumerate(requests):
            length = len(request.token_ids)
            input_ids[row, longest - length:] = torch.tensor(request.token_ids, dtype=torch.long)
            attention_mask[row, longest - length:] = 1
        greedy = sampling.temperature <= 0
        # Explicit settings override the model's generation_config defaults (top_k=50,
        # repetition penalties, ...), which would make the behaviour policy differ from the
        # policy the learner scores.
        generation_config = GenerationConfig(
            max_new_tokens=sampling.max_new_tokens,
            do_sample=not greedy,
            temperature=None if greedy else sampling.temperature,
            top_p=None if greedy else sampling.top_p,
            # 0 disables top-k; None would let transformers fall back to its default of 50.
            top_k=None if greedy else 0,
            eos_token_id=self.tokenizer.eos_token_id,
            pad_token_id=self.pad_token_id,
            output_scores=True,
            return_dict_in_generate=True,
            suppress_tokens=self.suppressed_tokens or None,
        )
        # Rows with stop strings stop generating once they have one (saving the tokens a model
        # writes after its tool call); the cut below is what makes each reply end there.
        criteria = []
        if any(request.stop_strings for request in requests):
            criteria.append(_StopStringsPerRow(self.tokenizer.decode, longest, [r.stop_strings for r in requests]))
        if on_step is not None:
            criteria.append(_EveryStep(on_step, top_logprobs))
        if cancelled is not None:
            criteria.append(_WhenCancelled(cancelled))
        stop_arguments = {"stopping_criteria": StoppingCriteriaList(criteria)} if criteria else {}
        # Every row's images in one list, row after row: the model puts their features on the
        # image tokens in that order. Text-only batches pass nothing.
        batch_images = [image for request in requests for image in request.images]
        image_arguments = {}
        if batch_images:
            if not takes_images(self.tokenizer):
                raise ValueError(NO_IMAGE_PROCESSOR)
            image_arguments = {name: value.to(self.device) for name, value in
                               self.tokenizer.image_inputs(batch_images, self.model.dtype).items()}
        with self._model_lock, torch.inference_mode():
            version = self.policy_version
            output = self.model.generate(
                input_ids=input_ids.to(self.device),
                attention_mask=attention_mask.to(self.device),
                generation_config=generation_config,
                **stop_arguments,
                **image_arguments,
            )
        new_tokens = output.sequences[:, longest:]
        # Scores are the processed logits the sampler drew from (temperature, top-p applied), so
        # their log-softmax is the behaviour policy's log-prob of each sampled token.
        step_logprobs = torch.stack(
            [torch.log_softmax(scores.float(), dim=-1) for scores in output.scores], dim=1
        )
        token_logprobs = step_logprobs.gather(-1, new_tokens.unsqueeze(-1)).squeeze(-1).cpu()
        if top_logprobs > 0:
            top = step_logprobs.topk(min(top_logprobs, step_logprobs.shape[-1]), dim=-1)
            top_values, top_ids = top.values.cpu(), top.indices.cpu()
        new_tokens = new_tokens.cpu()
        results = []
        eos = self.tokenizer.eos_token_id
        for row, request in enumerate(requests):
            tokens = new_tokens[row].tolist()
            # A stop string first: a row that generate() ended on one is padded afterwards, and
            # the pad id may be the end-of-turn id, which this turn did not sample.
            count = tokens_through_stop_string(self.tokenizer.decode, tokens, request.stop_strings)
            stopped = count is None and eos in tokens
            if count is None:
                count = tokens.index(eos) + 1 if stopped else len(tokens)
            elif eos in tokens[:count]:  # the turn ended before its stop string was complete
                count, stopped = tokens.index(eos) + 1, True
            tokens = tokens[:count]
            logprobs = token_logprobs[row, :count].tolist()
            if any(not math.isfinite(lp) for lp in logprobs):
                raise RuntimeError("sampled a token with zero probability (non-finite log-prob)")
            result = GenerationResult(
                token_ids=tokens,
                logprobs=logprobs,
                text=self.tokenizer.decode(tokens),
                stopped_on_eos=stopped,
                policy_version=version,
            )
            if top_logprobs > 0:
                top_lists = [_top_pairs(top_ids[row, step], top_values[row, step]) for step in range(count)]
                result = ResultWithTopLogprobs(**vars(result), top_logprobs=top_lists)
            results.append(result)
        return results

    def update_weights(self, update: Any) -> None:
        """Load any weights message, all or nothing: received (a collective's bytes too) and
        checked whole while generation goes on with the old weights, then swapped in between
        batches. An update that does not fit the model raises `WeightsRefused` before any tensor
        is copied, and the engine keeps its version."""
        state = self._weights.receive(update)
        if self.lora is not None:
            check_adapters_for(self.model, state)
        else:
            check_state_for(self.model, state)
        with self._model_lock:
            if self.lora is not None:
                load_adapters(self.model, state, checked=True)
            else:
                load_state_into(self.model, state, checked=True)
            self.policy_version = int(update.version)

    def end_episode(self, episode_id: str) -> None:
        pass

    async def close(self) -> None:
        self._weights.close()
        self.model = None


def _top_pairs(ids, values) -> list[tuple[int, float]]:
    """(token id, log-prob) pairs of a top-k, leaving out tokens the sampler cannot draw."""
    return [(i, v) for i, v in zip(ids.tolist(), values.tolist()) if math.isfinite(v)]


class _EveryStep:
    """A transformers stopping criterion that never stops a row: it hands each decoding step's new
    tokens, with their log-probs under the distribution they were drawn from (the step's processed
    scores, as `_generate_batch` computes them at the end) and the top tokens, to a callback."""

    def __init__(self, on_step, top_logprobs: int) -> None:
        self.on_step = on_step
        self.top_logprobs = top_logprobs

    def __call__(self, input_ids, scores, **kwargs):
        import torch

        # With output_scores, `scores` holds every step's processed scores so far.
        step = torch.log_softmax(scores[-1].float(), dim=-1)
        tokens = input_ids[:, -1]
        logprobs = step.gather(-1, tokens.unsqueeze(-1)).squeeze(-1).cpu().tolist()
        tops = [[] for _ in logprobs]
        if self.top_logprobs > 0:
            top = step.topk(min(self.top_logprobs, step.shape[-1]), dim=-1)
            ids, values = top.indices.cpu(), top.values.cpu()
            tops = [_top_pairs(ids[row], values[row]) for row in range(len(logprobs))]
        self.on_step(tokens.cpu().tolist(), logprobs, tops)
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


class _WhenCancelled:
    """A transformers stopping criterion that ends rows at the next decoding step once
    `cancelled()` says so: every row when it answers True (a server that is stopping), the rows it
    names when it answers a bool per row (their clients left). The batch returns what it has."""

    def __init__(self, cancelled) -> None:
        self.cancelled = cancelled

    def __call__(self, input_ids, scores, **kwargs):
        import torch

        answer = self.cancelled()
        if isinstance(answer, bool):
            return torch.full((input_ids.shape[0],), answer, dtype=torch.bool, device=input_ids.device)
        return torch.tensor([bool(row) for row in answer], dtype=torch.bool, device=input_ids.device)


class _StopStringsPerRow:
    """A transformers stopping criterion: a row is done once its new text holds one of its stop
    strings. transformers' own stop-string criterion needs a BPE-style vocabulary; this works with
    any tokenizer. Only the last few tokens are decoded each step: a stop string completed by the
    newest token lies within them."""

    _WINDOW_TOKENS = 32

    def __init__(self, decode, prompt_length: int, stop_strings: list[tuple[str, ...]]) -> None:
        self.decode = decode
        self.prompt_length = prompt_length
        self.stop_strings = stop_strings

    def __call__(self, input_ids, scores, **kwargs):
        import torch

        start = max(self.prompt_length, input_ids.shape[1] - self._WINDOW_TOKENS)
        done = []
        for row, stops in enumerate(self.stop_strings):
            text = self.decode(input_ids[row, start:].tolist()) if stops else ""
            done.append(any(stop in text for stop in stops))
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)
