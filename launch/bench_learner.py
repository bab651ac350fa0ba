"""`longhorizon bench learner-step`: time and peak memory of one learner update on long sequences.

It builds `--sequences` trajectories of `--tokens` tokens each (random token ids of the model's
vocabulary; the second half of each counts as generated, with made-up behaviour log-probs and
advantages of both signs) and runs one `Trainer.step` on them, as the learner would, for each
`--max-tokens-per-micro-batch` value given. Each value runs in a fresh process, so its peak
resident memory is its own. The step's peak memory follows the micro-batch budget: the logits of a
micro-batch are [sequences, length, vocabulary] floats, several copies of them live through the
backward pass, and a budget caps sequences x length.

Run: `longhorizon bench learner-step --tokens 4096 --sequences 2 --max-tokens-per-micro-batch 4096`
(`--logprob-chunk-tokens 0` computes the whole micro-batch's logits at once, for comparison)
(the default model is SmolLM2-135M-Instruct; `--model` takes any local Hugging Face folder).
A table for people, then one line of JSON.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from typing import Any


def _parse_budgets(text: str) -> list[int]:
    values = [int(item) for item in text.split(",") if item.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"budgets must be positive integers, got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    from longhorizon.common.config import LearnerConfig

    defaults = LearnerConfig()
    parser = argparse.ArgumentParser(prog="longhorizon bench learner-step", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="model folder or name (default %(default)s)")
    parser.add_argument("--model-cache", default=".cache/models", help="where converted models live")
    parser.add_argument("--sequences", type=int, default=2, help="trajectories in the step (default %(default)s)")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per trajectory (default %(default)s)")
    parser.add_argument("--micro-batch-size", type=int, default=defaults.micro_batch_size,
                        help="most sequences per micro-batch (default %(default)s)")
    parser.add_argument("--max-tokens-per-micro-batch", type=_parse_budgets,
                        default=[defaults.max_tokens_per_micro_batch],
                        help="comma-separated token budgets, one run each (default %(default)s)")
    parser.add_argument("--logprob-chunk-tokens", type=int, default=defaults.logprob_chunk_tokens,
                        help="positions per log-prob chunk, 0 for whole logits (default %(default)s)")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (default %(default)s)")
    parser.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)  # a child run's budget
    return parser


def measure_step(args: argparse.Namespace, budget: int) -> dict[str, Any]:
    """One learner step in this process; its wall time and peak resident memory."""
    import numpy as np
    import torch

    from longhorizon.common.config import LearnerConfig
    from longhorizon.common.models import load_causal_lm, resolve_model_path
    from longhorizon.launch.bench_search import PeakRss
    from longhorizon.learner.trainer import Example, Trainer, plan_micro_batches

    torch.set_num_threads(args.threads)
    model_path = resolve_model_path(args.model, args.model_cache)
    model = load_causal_lm(str(model_path)).eval()
    vocab_size = model.get_input_embeddings().num_embeddings
    rng = np.random.default_rng(0)
    examples = []
    for row in range(args.sequences):
        mask = np.zeros(args.tokens, np.float32)
        mask[args.tokens // 2:] = 1.0
        examples.append(Example(
            token_ids=rng.integers(0, vocab_size, size=args.tokens).astype(np.int64),
            loss_mask=mask,
            behaviour_logprobs=(-rng.random(args.tokens) * 5 * mask).astype(np.float32),
            advantage=1.0 if row % 2 else -1.0,
        ))
    config = LearnerConfig(
        micro_batch_size=args.micro_batch_size, max_tokens_per_micro_batch=budget,
        logprob_chunk_tokens=args.logprob_chunk_tokens,
    )
    trainer = Trainer(model, config)
    plan = plan_micro_batches(examples, config.micro_batch_size, config.max_tokens_per_micro_batch)
    with PeakRss() as memory:
        started = time.perf_counter()
        trainer.step(examples)
        seconds = time.perf_counter() - started
    return {
        "max_tokens_per_micro_batch": budget,
        "micro_batches": len(plan),
        "step_s": seconds,
        "tokens_per_s": args.sequences * args.tokens / seconds,
        "peak_rss_mb": memory.peak_bytes / 2**20,
        "peak_added_mb": memory.added_mb,
    }


def main(argv: list[str]) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_request:
        return int(exit_request.code or 0)
    if args.sequences < 1 or args.tokens < 2:
        parser.print_usage(sys.stderr)
        print("longhorizon bench learner-step: error: --sequences must be >= 1 and --tokens >= 2", file=sys.stderr)
        return 2
    if args.one is not None:
        print(json.dumps(measure_step(args, args.one)))
        return 0
    runs = []
    for budget in args.max_tokens_per_micro_batch:
        child = [
            "--model", args.model, "--model-cache", args.model_cache, "--sequences", str(args.sequences),
            "--tokens", str(args.tokens), "--micro-batch-size", str(args.micro_batch_size),
            "--threads", str(args.threads), "--logprob-chunk-tokens", str(args.logprob_chunk_tokens),
        ]
        completed = subprocess.run(
            [sys.executable, "-m", "longhorizon.launch.bench_learner", *child, "--one", str(budget)],
            capture_output=True, text=True,
        )
        if completed.returncode != 0:
            print(completed.stderr[-2000:], file=sys.stderr)
            print(f"longhorizon bench learner-step: the run with budget {budget} failed "
                  f"(exit {completed.returncode}; -9 is the kernel's out-of-memory killer)", file=sys.stderr)
            return 1
        runs.append(json.loads(completed.stdout.strip().splitlines()[-1]))
    print(f"model {args.model}: {args.sequences} sequences x {args.tokens} tokens, micro_batch_size "
          f"{args.micro_batch_size}, log-prob chunks of {args.logprob_chunk_tokens or 'all'} tokens")
    print(f"{'budget (tokens)':>16} {'micro-batches':>14} {'step s':>8} {'tokens/s':>9} {'peak RSS MB':>12} {'added MB':>9}")
    for run in runs:
        print(f"{run['max_tokens_per_micro_batch']:>16} {run['micro_batches']:>14} {run['step_s']:>8.1f} "
              f"{run['tokens_per_s']:>9.1f} {run['peak_rss_mb']:>12.0f} {run['peak_added_mb']:>9.0f}")
    print(json.dumps({"model": args.model, "sequences": args.sequences, "tokens": args.tokens,
                      "logprob_chunk_tokens": args.logprob_chunk_tokens, "runs": runs}, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
