"""`longhorizon bench generation`: generation throughput and weight-update latency of any engine.

For each engine named with `--engine` (hf, vllm, openai, scripted, or one registered under the
`longhorizon.engines` entry points) it measures, through the Engine protocol only:
- start time: from constructing the engine to it being ready;
- tokens/s at each batch size: B requests sent at once (each its own prompt, sampling at the
  configured temperature), generated tokens counted over the wall time until the last returns;
- weight-update latency: `update_weights` with the model's own weights, inline tensors and a
  safetensors folder, median of `--updates` runs;
- optionally (`--logprob-check`) the behaviour/learner log-prob mismatch: the engine's log-probs
  against the learner's (transformers, same weights, same tokens, same temperature).

`--model-shape qwen2.5-1.5b` (or qwen2.5-7b) with `--load-format dummy` runs vLLM on random weights
of that architecture (no download: the tokenizer comes from `--tokenizer-from`), for GPU sizing.
A table for people, then one line of JSON.

Run: `longhorizon bench generation --engine hf --engine vllm --batch-sizes 1,4,8 --new-tokens 32`
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from longhorizon.launch.bench.memory import GIB, memory_use
from longhorizon.launch.bench.tables import BenchStopped, Column, parsed, print_table, run_as_command
from longhorizon.common.models import load_tokenizer, load_causal_lm, resolve_model_path
from longhorizon.actor.engines.base import (
    GenerationRequest,
    capabilities_of,
    engine_class,
    make_engine,
    EngineSettings,
    EngineError,
    engine_names,
)
from longhorizon.common.config import SamplingConfig

PROG = "longhorizon bench generation"

MODEL_SHAPES: dict[str, dict[str, Any]] = {
    # Public architecture settings of the Qwen2.5 instruct models; weights are random (dummy).
    "qwen2.5-1.5b": {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 1536,
        "intermediate_size": 8960, "num_hidden_layers": 28, "num_attention_heads": 12,
        "num_key_value_heads": 2, "vocab_size": 151936, "max_position_embeddings": 32768,
        "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "hidden_act": "silu",
        "use_sliding_window": False, "torch_dtype": "bfloat16",
    },
    "qwen2.5-7b": {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 3584,
        "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
        "num_key_value_heads": 4, "vocab_size": 152064, "max_position_embeddings": 32768,
        "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "hidden_act": "silu",
        "use_sliding_window": False, "torch_dtype": "bfloat16",
    },
}

_TOPICS = [
    "the sea", "a mountain village", "bread", "the moon", "a lost key", "trains", "bees", "winter",
    "a lighthouse", "rivers", "chess", "a small robot", "rain", "the desert", "a market", "owls",
]


def write_shaped_model_folder(shape: str, folder: Path, tokenizer_from: Path) -> Path:
    """A model folder with only a config (of a known architecture) and a borrowed tokenizer.

    Enough for vLLM with load_format='dummy'. The borrowed tokenizer's ids must fit the
    architecture's vocabulary, which holds for any tokenizer smaller than it.
    """
    if shape not in MODEL_SHAPES:
        raise ValueError(f"unknown model shape {shape!r}; available: {', '.join(sorted(MODEL_SHAPES))}")

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer(tokenizer_from)
    if len(tokenizer) > MODEL_SHAPES[shape]["vocab_size"]:
        raise ValueError(f"the tokenizer of {tokenizer_from} is larger than {shape}'s vocabulary")
    tokenizer.save_pretrained(folder)
    config = dict(MODEL_SHAPES[shape])
    config.update(eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return folder


def throughput(tokens: int, seconds: float) -> float:
    return tokens / seconds if seconds > 0 else 0.0


def logprob_mismatch(engine_logprobs: list[list[float]], learner_logprobs: list[list[float]]) -> dict[str, float]:
    """Max and mean |engine - learner| over all generated tokens, and the token count."""
    differences = [
        abs(a - b) for row_a, row_b in zip(engine_logprobs, learner_logprobs, strict=True)
        for a, b in zip(row_a, row_b, strict=True)
    ]
    if not differences:
        return {"tokens": 0, "max_abs_diff": 0.0, "mean_abs_diff": 0.0}
    return {
        "tokens": len(differences),
        "max_abs_diff": max(differences),
        "mean_abs_diff": sum(differences) / len(differences),
    }


def _messages(count: int, offset: int = 0) -> list[list[dict]]:
    return [
        [{"role": "user", "content": f"Write a short story about {_TOPICS[(offset + i) % len(_TOPICS)]} (number {offset + i})."}]
        for i in range(count)
    ]


def _prompts(engine, count: int, offset: int = 0) -> list[list[int]]:
    return [engine.tokenizer.prompt_tokens(messages) for messages in _messages(count, offset)]


async def _generate_batch(engine, prompts: list[list[int]], tag: str, offset: int = 0):
    import trio


    results = [None] * len(prompts)
    conversations = _messages(len(prompts), offset)  # text engines (scripted) act on the messages

    async def one(index: int) -> None:
        results[index] = await engine.generate(
            GenerationRequest(token_ids=prompts[index], episode_id=f"{tag}-{index}", messages=conversations[index])
        )

    async with trio.open_nursery() as nursery:
        for index in range(len(prompts)):
            nursery.start_soon(one, index)
    return results


def _plays_model(name: str) -> bool:
    """Whether the engine plays a language model: scripted policies have no weights to update,
    no model path to resolve and no log-probs to compare with the learner's."""
    return capabilities_of(engine_class(name)).uses_model


def _make_engine(name: str, settings, load_format: str):
    import dataclasses


    if load_format != "auto":
        if name != "vllm":
            raise ValueError(f"--load-format {load_format} applies to the vllm engine only")
        settings = dataclasses.replace(settings, engine_options={**settings.engine_options, "load_format": load_format})
    return make_engine(name, settings)


def _learner_logprobs(model, prompts, results, temperature: float) -> list[list[float]]:
    import numpy as np
    import torch

    from longhorizon.learner.logprobs import Example, pad_examples, token_logprobs

    rows = []
    for prompt, result in zip(prompts, results):
        tokens = prompt + result.token_ids
        mask = np.array([0] * len(prompt) + [1] * len(result.token_ids), np.float32)
        example = Example(np.array(tokens), mask, np.zeros(len(tokens), np.float32), 0.0)
        batch = pad_examples([example], pad_token_id=0)
        with torch.no_grad():
            logprobs = token_logprobs(model, batch, temperature=temperature)[0]
        rows.append(logprobs[batch.loss_mask[0] > 0].tolist())
    return rows


def bench_engine(name: str, args: argparse.Namespace, model_path: str) -> dict[str, Any]:
    """Start one engine, measure it, close it; returns its figures."""
    import trio


    sampling = SamplingConfig(temperature=args.temperature, top_p=1.0, max_new_tokens=args.new_tokens)
    settings = EngineSettings(
        model_path=model_path, dtype=args.dtype, sampling=sampling, max_batch_size=max(args.batch_sizes),
        env_name=args.env, seed=args.seed, torch_threads=args.torch_threads,
        scripted_policy="random",  # needs no task: the bench plays none
    )
    started = time.perf_counter()
    engine = _make_engine(name, settings, args.load_format)
    result: dict[str, Any] = {"engine": name, "start_seconds": time.perf_counter() - started, "batches": []}

    async def measure() -> None:
        await _generate_batch(engine, _prompts(engine, 1, offset=99), "warmup", offset=99)
        for batch_size in args.batch_sizes:
            prompts = _prompts(engine, batch_size)
            began = time.perf_counter()
            results = await _generate_batch(engine, prompts, f"b{batch_size}")
            seconds = time.perf_counter() - began
            tokens = sum(len(r.token_ids) for r in results)
            result["batches"].append({
                "batch_size": batch_size, "tokens": tokens, "seconds": seconds,
                "tokens_per_s": throughput(tokens, seconds),
                "prompt_tokens_mean": sum(len(p) for p in prompts) / len(prompts),
            })
            if args.logprob_check and batch_size == max(args.batch_sizes):
                result["logprob_prompts"], result["logprob_results"] = prompts, results
        # vLLM runs its engine in child processes.
        result["memory_gib"] = memory_use(children=True).rss_bytes / GIB

    try:
        trio.run(measure)
        result["weight_update_seconds"] = _time_updates(engine, name, args, model_path)
    finally:
        trio.run(engine.close)
    if args.logprob_check:
        prompts, results = result.pop("logprob_prompts"), result.pop("logprob_results")
        if not _plays_model(name) or args.load_format == "dummy":
            result["logprob_mismatch"] = None
        else:
            learner = load_causal_lm(model_path, args.dtype).eval()
            learner_rows = _learner_logprobs(learner, prompts, results, args.temperature if args.temperature > 0 else 1.0)
            result["logprob_mismatch"] = logprob_mismatch([r.logprobs for r in results], learner_rows)
    return result


def _time_updates(engine, name: str, args: argparse.Namespace, model_path: str) -> dict[str, float | None]:
    """Median seconds of update_weights per transport; None where the engine cannot reload."""
    if args.updates < 1 or args.load_format == "dummy" or not _plays_model(name) or not model_path:
        return {"inline": None, "path": None}
    from longhorizon.learner.broadcast import make_weights_update

    model = load_causal_lm(model_path, args.dtype)
    figures: dict[str, float | None] = {}
    scratch = Path(tempfile.mkdtemp(prefix="longhorizon-bench-weights-"))
    try:
        version = 1
        for transport in ("inline", "path"):
            seconds = []
            for _ in range(args.updates):
                update = make_weights_update(model, version, transport, weights_dir=scratch)
                began = time.perf_counter()
                try:
                    engine.update_weights(update)
                except (EngineError, NotImplementedError):
                    seconds = []
                    break
                seconds.append(time.perf_counter() - began)
                version += 1
            figures[transport] = statistics.median(seconds) if seconds else None
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return figures


def print_report(report: dict[str, Any]) -> None:
    """Two tables for people: throughput per batch; weight updates, memory, log-prob mismatch."""
    results, settings = report["engines"], report["settings"]
    print(
        f"generation: model {settings['model']}, {settings['dtype']}, {settings['new_tokens']} new tokens, "
        f"temperature {settings['temperature']}, load format {settings['load_format']}"
    )
    print_table(
        [Column("engine", 10, left=True), Column("start s", 8, ".1f"), Column("batch", 6, "d"),
         Column("tokens", 7, "d"), Column("seconds", 8, ".2f"), Column("tokens/s", 9, ".1f")],
        [[result["engine"], result["start_seconds"], row["batch_size"], row["tokens"], row["seconds"],
          row["tokens_per_s"]] for result in results for row in result["batches"]],
    )
    rows = []
    for result in results:
        updates = result["weight_update_seconds"]
        mismatch = result.get("logprob_mismatch")
        mismatch_text = (
            f"{mismatch['max_abs_diff']:.2e} / {mismatch['mean_abs_diff']:.2e} ({mismatch['tokens']} tok)"
            if mismatch else "-"
        )
        rows.append([result["engine"], _seconds(updates["inline"]), _seconds(updates["path"]), result["memory_gib"],
                     mismatch_text])
    print_table(
        [Column("engine", 10, left=True), Column("update inline s", 16), Column("update path s", 14),
         Column("memory GiB", 11, ".2f"), Column("logprob |diff| max / mean", 27)],
        rows,
    )


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _batch_sizes(text: str) -> list[int]:
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"batch sizes must be comma-separated integers, got {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"batch sizes must be at least 1, got {text!r}")
    return sizes


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="longhorizon bench generation",
        description="Generation tokens/s per batch size and weight-update latency per engine; a table, then one line of JSON.",
    )
    parser.add_argument("--engine", action="append", dest="engines", default=None,
                        help="engine to measure (repeatable; default hf)")
    parser.add_argument("--model", default="smollm2-135m-instruct",
                        help="model.path value: a local folder, smollm2-135m-instruct or tiny:<folder> (default %(default)s)")
    parser.add_argument("--model-shape", choices=sorted(MODEL_SHAPES), default=None,
                        help="random weights of this architecture (implies --load-format dummy; vllm only)")
    parser.add_argument("--tokenizer-from", default="smollm2-135m-instruct",
                        help="with --model-shape: model whose tokenizer is borrowed (default %(default)s)")
    parser.add_argument("--load-format", choices=("auto", "dummy"), default="auto",
                        help="vllm: dummy starts with random weights (no weight updates) (default %(default)s)")
    parser.add_argument("--cache-dir", default="", help="model cache folder (default: models/ in the user's cache)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--batch-sizes", type=_batch_sizes, default=[1, 4, 8], help="comma-separated (default 1,4,8)")
    parser.add_argument("--new-tokens", type=int, default=32, help="max new tokens per request (default %(default)s)")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default %(default)s)")
    parser.add_argument("--updates", type=int, default=3, help="weight updates timed per transport (default %(default)s)")
    parser.add_argument("--logprob-check", action="store_true",
                        help="compare the engine's log-probs with the learner's on the largest batch's tokens")
    parser.add_argument("--env", default="codebook", help="scripted engine: env whose scripted policy acts (default %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--torch-threads", type=int, default=1, help="hf engine: torch CPU threads (default %(default)s)")
    return parser


def _check(args: argparse.Namespace) -> None:
    engines = args.engines or ["hf"]
    unknown = [name for name in engines if name not in engine_names()]
    if unknown:
        raise ValueError(f"unknown engine {unknown[0]!r}; available: {', '.join(engine_names())}")
    if args.new_tokens < 1:
        raise ValueError(f"--new-tokens must be at least 1, got {args.new_tokens}")
    if args.temperature < 0:
        raise ValueError(f"--temperature must be >= 0, got {args.temperature}")
    if args.model_shape and set(engines) != {"vllm"}:
        raise ValueError("--model-shape runs random weights through vLLM only: use --engine vllm")


def run(argv: list[str]) -> dict[str, Any]:
    """Measure as the options say, print the tables, return the settings and each engine's figures."""
    args = parsed(build_parser(), argv, check=_check)
    args.engines = args.engines or ["hf"]

    scratch = None
    try:
        if args.model_shape:
            args.load_format = "dummy"
            scratch = Path(tempfile.mkdtemp(prefix="longhorizon-shape-"))
            tokenizer_folder = resolve_model_path(args.tokenizer_from, args.cache_dir)
            model_path = str(write_shaped_model_folder(args.model_shape, scratch / args.model_shape, tokenizer_folder))
            model_label = f"{args.model_shape} (random weights)"
        else:
            needs_model = any(_plays_model(name) for name in args.engines)
            model_path = str(resolve_model_path(args.model, args.cache_dir)) if needs_model else ""
            model_label = args.model
        results = [bench_engine(name, args, model_path) for name in args.engines]
    except (EngineError, ValueError) as error:
        raise BenchStopped(1, f"error: {error}") from error
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    settings = {
        "model": model_label, "dtype": args.dtype, "new_tokens": args.new_tokens, "temperature": args.temperature,
        "load_format": args.load_format, "batch_sizes": args.batch_sizes,
    }
    report = {"settings": settings, "engines": results}
    print_report(report)
    return report


def main(argv: list[str]) -> int:
    return run_as_command(PROG, run, argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
