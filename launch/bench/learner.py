"""`longhorizon bench learner`: the learner's update step against a bare torch loop, time and memory.

It builds `--sequences` trajectories of `--tokens` tokens each (random token ids of the model's
vocabulary; the second half of each counts as generated, with made-up behaviour log-probs and
advantages of both signs), then times `--steps` update steps (after one untimed warm-up step) of:

- `longhorizon`: `Trainer.step` as the learner runs it (micro-batches by `--micro-batch-size` and
  `--max-tokens-per-micro-batch`, decoupled PPO, log-probs in chunks of each
  `--logprob-chunk-tokens` value given, 0 meaning whole logits);
- `bare torch`: the same micro-batches through a plain loop (forward, whole logits, log-softmax,
  a policy-gradient loss, backward, gradient clip, AdamW step), which is what the framework's
  overhead is measured against.

With `--shape textcraft` or `--shape codebook` the trajectories come in groups of `--group-size`
members that share a prompt, as a GRPO step's do: the prompt is as long as the environment's
first prompt in SmolLM2's chat template (TextCraft: 542 tokens, the median over its first 40
training tasks, 418 to 629; codebook: 32), the members' own tokens after it run from half of the
rest up to `--tokens` in all, and only they count as generated. `--shared-prefix off,on` runs our
step both ways (`learner.shared_prefix`: each group's common prefix encoded once). Each run
reports the tokens trained (the examples' tokens) and the tokens computed (the positions the
forward passes run: padding included, a shared prefix once per micro-batch).

With `--ranks 1,2` each is run again with the learner split over that many ranks (processes
under torch.distributed, gloo on CPU, NCCL on GPUs): ours is `Trainer.step` with the model
sharded by FSDP2 and each rank given its share of the sequences by tokens; the bare loop shards
the model the same way and runs the same share. On CPU the ranks split `--threads` between them.

Each run is a fresh process (or set of processes), so its peak memory is its own (resident
memory on CPU, the CUDA allocator's peak on a GPU; the largest over the ranks). The step's peak memory follows the micro-batch budget and, with
whole logits, the `[sequences, length, vocabulary]` floats that live through the backward pass.

Run: `longhorizon bench learner --tokens 2048 --sequences 4 --logprob-chunk-tokens 0,1024`, or
`longhorizon bench learner --shape textcraft --tokens 1024 --sequences 8 --shared-prefix off,on --no-bare`
(the default model is SmolLM2-135M-Instruct; `--model` takes any local Hugging Face folder).
A table for people, then one line of JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

from longhorizon.common.args import parse_args
from longhorizon.launch.bench.memory import MIB, PeakRss
from longhorizon.launch.bench.tables import BenchStopped, Column, parsed, print_table, run_as_command
from longhorizon.common.config import LearnerConfig
from longhorizon.common.models import load_causal_lm, resolve_device, resolve_model_path
from longhorizon.learner import distributed
from longhorizon.learner.distributed import exit_without_teardown, STORE_FILE_VARIABLE

PROG = "longhorizon bench learner"


def _non_negative_list(text: str) -> list[int]:
    try:
        values = [int(item) for item in text.split(",") if item.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 0, got {text!r}")
    return values


# Tokens of each environment's first prompt in SmolLM2-135M-Instruct's chat template (median over
# the first 40 training tasks: TextCraft 418 to 629, codebook always 32).
PROMPT_TOKENS = {"random": 0, "textcraft": 542, "codebook": 32}


def _switches(text: str) -> list[bool]:
    values = [item.strip() for item in text.split(",") if item.strip()]
    if not values or any(value not in ("off", "on") for value in values):
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of off and on, got {text!r}")
    return [value == "on" for value in values]


def build_parser() -> argparse.ArgumentParser:
    defaults = LearnerConfig()
    parser = argparse.ArgumentParser(prog="longhorizon bench learner", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="model folder or name (default %(default)s)")
    parser.add_argument("--model-cache", default="", help="where converted models live (default: models/ in the user's cache)")
    parser.add_argument("--sequences", type=int, default=4, help="trajectories per step (default %(default)s)")
    parser.add_argument("--tokens", type=int, default=512, help="tokens per trajectory (default %(default)s)")
    parser.add_argument("--steps", type=int, default=2, help="timed steps after one warm-up (default %(default)s)")
    parser.add_argument("--micro-batch-size", type=int, default=defaults.micro_batch_size,
                        help="most sequences per micro-batch (default %(default)s)")
    parser.add_argument("--max-tokens-per-micro-batch", type=int, default=defaults.max_tokens_per_micro_batch,
                        help="most padded tokens per micro-batch (default %(default)s)")
    parser.add_argument("--logprob-chunk-tokens", type=_non_negative_list, default=[defaults.logprob_chunk_tokens],
                        help="comma-separated chunk sizes, one run each; 0 is whole logits (default %(default)s)")
    parser.add_argument("--shape", choices=sorted(PROMPT_TOKENS), default="random",
                        help="random sequences, or groups sharing a prompt as long as that env's (default %(default)s)")
    parser.add_argument("--group-size", type=int, default=8, help="members per group (default %(default)s)")
    parser.add_argument("--prompt-tokens", type=int, default=None,
                        help="a group's prompt length instead of the shape's recorded one")
    parser.add_argument("--shared-prefix", type=_switches, default=[False],
                        help="off, on or off,on: our step with learner.shared_prefix (default off)")
    parser.add_argument("--no-bare", action="store_true", help="skip the bare torch loop")
    parser.add_argument("--gradient-checkpointing", choices=("on", "off", "auto"), default="auto",
                        help="learner.gradient_checkpointing for our step: on, off or auto, which turns it on "
                             "where a micro-batch's activations outweigh the training state (default %(default)s)")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default %(default)s)")
    parser.add_argument("--precision", default="fp32", help="fp32 or bf16-mixed (default %(default)s)")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads in all (default %(default)s)")
    parser.add_argument("--ranks", type=_non_negative_list, default=[1],
                        help="comma-separated learner rank counts, one run each (default 1)")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a child run: "bare" or a chunk size
    parser.add_argument("--one-shared", action="store_true", help=argparse.SUPPRESS)  # the child shares prefixes
    return parser


def _examples(args: argparse.Namespace, vocab_size: int) -> list:
    """`--sequences` trajectories: random and alone, or in groups that share a prompt (`--shape`)."""
    import numpy as np

    from longhorizon.learner.logprobs import Example

    rng = np.random.default_rng(0)
    prompt_tokens = _prompt_tokens(args)
    grouped = args.shape != "random"
    examples = []
    prompt = rng.integers(0, vocab_size, size=prompt_tokens)
    for row in range(args.sequences):
        member = row % args.group_size if grouped else 0
        if grouped and member == 0:  # a new group: a new prompt
            prompt = rng.integers(0, vocab_size, size=prompt_tokens)
        if grouped:
            # From half the rest to all of it, spread over the group's members.
            rest = args.tokens - prompt_tokens
            fraction = 1.0 if args.group_size == 1 else 0.5 + 0.5 * member / (args.group_size - 1)
            own = max(1, round(rest * fraction))
            tokens = np.concatenate([prompt, rng.integers(0, vocab_size, size=own)])
            generated_from = prompt_tokens
        else:
            tokens = rng.integers(0, vocab_size, size=args.tokens)
            generated_from = args.tokens // 2
        mask = np.zeros(len(tokens), np.float32)
        mask[generated_from:] = 1.0
        examples.append(Example(
            token_ids=tokens.astype(np.int64),
            loss_mask=mask,
            behaviour_logprobs=(-rng.random(len(tokens)) * 5 * mask).astype(np.float32),
            advantage=1.0 if row % 2 else -1.0,
            group=row // args.group_size if grouped else None,
        ))
    return examples


def _prompt_tokens(args: argparse.Namespace) -> int:
    return PROMPT_TOKENS[args.shape] if args.prompt_tokens is None else args.prompt_tokens


def _bare_step(model, optimizer, micro_batches, precision: str) -> None:
    """Forward, whole logits, a policy-gradient loss, backward, clip, AdamW: nothing else."""
    import torch

    total = sum(float(micro.loss_mask.sum()) for micro in micro_batches)
    for micro in micro_batches:
        with torch.autocast(device_type=micro.input_ids.device.type, dtype=torch.bfloat16,
                            enabled=precision == "bf16-mixed"):
            logits = model(input_ids=micro.input_ids, attention_mask=micro.attention_mask).logits[:, :-1]
        logprobs = torch.log_softmax(logits.float(), dim=-1).gather(-1, micro.input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
        loss = -(micro.advantages.unsqueeze(-1) * logprobs * micro.loss_mask).sum() / total
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def measure(args: argparse.Namespace, kind: str, shared_prefix: bool = False) -> dict[str, Any]:
    """Timed steps of one kind ("bare" or a log-prob chunk size; ours with `shared_prefix` or
    not) in this process (one rank)."""
    import torch

    from longhorizon.learner.logprobs import pad_examples
    from longhorizon.learner.shared_prefix import computed_tokens, plan_group_micro_batches, plan_micro_batches
    from longhorizon.learner.trainer import Trainer

    ranks = distributed.ranks_from_environment(int(os.environ.get("WORLD_SIZE", "1")))
    torch.set_num_threads(max(1, args.threads // ranks.world_size))
    torch.manual_seed(0)
    device = distributed.rank_device(resolve_device(args.device), ranks)
    distributed.init_process_group(ranks, device, timeout_s=600)
    model = load_causal_lm(str(resolve_model_path(args.model, args.model_cache))).to(device).eval()
    examples = _examples(args, model.get_input_embeddings().num_embeddings)
    share = distributed.split_by_tokens([len(e.token_ids) for e in examples], ranks.world_size)[ranks.rank]
    trained = sum(len(e.token_ids) for e in examples)  # the whole step's, every rank's
    examples = [examples[i] for i in share]
    if shared_prefix:
        plan_with_prefixes = plan_group_micro_batches(examples, args.micro_batch_size, args.max_tokens_per_micro_batch)
    else:
        plan_with_prefixes = [(chunk, 0) for chunk in plan_micro_batches(
            examples, args.micro_batch_size, args.max_tokens_per_micro_batch)]
    plan = [chunk for chunk, _ in plan_with_prefixes]
    computed = sum(computed_tokens(pad_examples(chunk, 0, prefix).input_ids, prefix)
                   for chunk, prefix in plan_with_prefixes)
    if kind == "bare":
        micro_batches = [pad_examples(chunk, 0).to(device) for chunk in plan]
        if ranks.distributed:
            distributed.shard_model(model, distributed.decoder_layers(model))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
        model.train()

        checkpointing = None

        def step() -> None:
            _bare_step(model, optimizer, micro_batches, args.precision)
    else:
        trainer = Trainer(model, LearnerConfig(
            micro_batch_size=args.micro_batch_size, max_tokens_per_micro_batch=args.max_tokens_per_micro_batch,
            logprob_chunk_tokens=int(kind), precision=args.precision,
            gradient_checkpointing=_checkpointing_setting(args.gradient_checkpointing), num_ranks=ranks.world_size,
            shared_prefix=shared_prefix,
        ), ranks=ranks)
        checkpointing = trainer.gradient_checkpointing

        def step() -> None:
            trainer.step(examples)

    def synchronise() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if ranks.distributed:
            torch.distributed.barrier()

    step()  # warm-up: allocator, optimiser state, kernels
    synchronise()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    with PeakRss() as memory:
        for _ in range(args.steps):
            started = time.perf_counter()
            step()
            synchronise()
            times.append(time.perf_counter() - started)
    seconds = statistics.median(times)
    distributed.destroy_process_group()
    return {
        "kind": "bare torch" if kind == "bare" else "longhorizon",
        "ranks": ranks.world_size,
        "logprob_chunk_tokens": None if kind == "bare" else int(kind),
        "shared_prefix": shared_prefix,
        "gradient_checkpointing": checkpointing,
        "micro_batches": len(plan),
        "tokens_trained": trained,
        "tokens_computed": computed,
        "step_s": seconds,
        "tokens_per_s": trained / seconds,
        "peak_rss_mb": memory.peak_bytes / MIB,
        "peak_cuda_mb": torch.cuda.max_memory_allocated(device) / MIB if device.type == "cuda" else None,
    }


def _checkpointing_setting(switch: str) -> bool | str:
    """--gradient-checkpointing as learner.gradient_checkpointing takes it."""
    return {"on": True, "off": False}.get(switch, switch)


def _check(args: argparse.Namespace) -> None:
    if args.sequences < 1 or args.tokens < 2 or args.steps < 1 or args.max_tokens_per_micro_batch < 1:
        raise ValueError("--sequences, --steps and --max-tokens-per-micro-batch must be >= 1 and --tokens >= 2")
    if args.group_size < 1:
        raise ValueError("--group-size must be >= 1")
    if args.prompt_tokens is not None and args.prompt_tokens < 1:
        raise ValueError("--prompt-tokens must be >= 1")
    if args.shape != "random" and _prompt_tokens(args) + 2 > args.tokens:
        raise ValueError(f"--tokens must exceed the prompt ({_prompt_tokens(args)} tokens) by at least 2")
    if args.shape == "random" and any(args.shared_prefix):
        raise ValueError("--shared-prefix on needs groups: --shape textcraft or codebook")


def run(argv: list[str]) -> dict[str, Any]:
    """Measure each kind of run as the options say, in processes of its own, print the table and
    return the settings and runs."""
    args = parsed(build_parser(), argv, check=_check)
    if args.one is not None:
        raise BenchStopped(2, "error: --one measures inside a process the benchmark starts; run the benchmark "
                              "without it")
    if min(args.ranks) < 1:
        raise BenchStopped(2, "error: --ranks must be >= 1")
    kinds = [(str(chunk), shared) for shared in args.shared_prefix for chunk in args.logprob_chunk_tokens]
    kinds += [] if args.no_bare else [("bare", False)]
    shared = [
        "--model", args.model, "--model-cache", args.model_cache, "--sequences", str(args.sequences),
        "--tokens", str(args.tokens), "--steps", str(args.steps), "--micro-batch-size", str(args.micro_batch_size),
        "--max-tokens-per-micro-batch", str(args.max_tokens_per_micro_batch), "--device", args.device,
        "--precision", args.precision, "--threads", str(args.threads),
        "--shape", args.shape, "--group-size", str(args.group_size),
        *(["--prompt-tokens", str(args.prompt_tokens)] if args.prompt_tokens is not None else []),
        "--gradient-checkpointing", args.gradient_checkpointing,
    ]
    runs = []
    for rank_count in args.ranks:
        for kind, shared_prefix in kinds:
            try:
                runs.append(_run_ranks(shared + (["--one-shared"] if shared_prefix else []), kind, rank_count))
            except RuntimeError as error:
                raise BenchStopped(1, str(error)) from error
    for one in runs:
        bare = next((other for other in runs if other["kind"] == "bare torch" and other["ranks"] == one["ranks"]), None)
        one["overhead_vs_bare"] = one["step_s"] / bare["step_s"] - 1 if bare else None
    result = {"model": args.model, "sequences": args.sequences, "tokens": args.tokens, "shape": args.shape,
              "group_size": args.group_size, "prompt_tokens": _prompt_tokens(args), "precision": args.precision,
              "gradient_checkpointing": args.gradient_checkpointing, "micro_batch_size": args.micro_batch_size,
              "max_tokens_per_micro_batch": args.max_tokens_per_micro_batch, "steps": args.steps, "runs": runs}
    print_report(result)
    return result


def main(argv: list[str]) -> int:
    args = parse_args(build_parser(), argv, check=_check)
    if isinstance(args, int):
        return args
    if args.one is not None:  # a process the benchmark started: one measurement, as JSON
        print(json.dumps(measure(args, args.one, args.one_shared)))
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            exit_without_teardown(0)  # a rank: see there why
        return 0
    return run_as_command(PROG, run, argv)


def print_report(result: dict[str, Any]) -> None:
    """A table for people."""
    shape = " x" if result["shape"] == "random" else (
        f" in groups of {result['group_size']} sharing a {result['prompt_tokens']}-token prompt ({result['shape']}), "
        "up to")
    print(f"model {result['model']}: {result['sequences']} sequences{shape} {result['tokens']} tokens, "
          f"{result['precision']}, gradient checkpointing {result['gradient_checkpointing']}, "
          f"micro-batches of <= {result['micro_batch_size']} sequences and {result['max_tokens_per_micro_batch']} "
          f"tokens, median of {result['steps']} steps")
    rows = []
    for run in result["runs"]:
        chunk = "-" if run["logprob_chunk_tokens"] is None else (run["logprob_chunk_tokens"] or "whole")
        gpu = "-" if run["peak_cuda_mb"] is None else f"{run['peak_cuda_mb']:.0f}"
        overhead = "-" if run["overhead_vs_bare"] is None else f"{run['overhead_vs_bare']:+.1%}"
        checkpointing = {None: "-", True: "on", False: "off"}[run.get("gradient_checkpointing")]
        rows.append([run["kind"], run["ranks"], chunk, "on" if run.get("shared_prefix") else "off", checkpointing,
                     run["tokens_trained"], run["tokens_computed"], run["step_s"], run["tokens_per_s"],
                     run["peak_rss_mb"], gpu, overhead])
    print_table(
        [Column("run", 12), Column("ranks", 5), Column("log-prob chunk", 15), Column("shared prefix", 13),
         Column("checkpointing", 13),
         Column("tokens trained", 14), Column("tokens computed", 15), Column("step s", 8, ".2f"),
         Column("tokens/s", 9, ".1f"), Column("peak RSS MB", 12, ".0f"), Column("peak GPU MB", 12),
         Column("vs bare", 8)],
        rows,
    )


def _run_ranks(shared: list[str], kind: str, rank_count: int) -> dict[str, Any]:
    """One measurement in fresh processes, one per rank (meeting through a file store, gloo on
    the loopback interface); rank 0's timings, the largest peak memory of any rank."""
    import tempfile


    command = [sys.executable, "-m", "longhorizon.launch.bench.learner", *shared, "--one", kind]
    with tempfile.TemporaryDirectory(prefix="bench-learner-") as scratch:
        processes = []
        for rank in range(rank_count):
            environment = dict(os.environ)
            if rank_count > 1:
                environment.update({
                    STORE_FILE_VARIABLE: os.path.join(scratch, "store"), "GLOO_SOCKET_IFNAME": "lo",
                    "WORLD_SIZE": str(rank_count), "RANK": str(rank), "LOCAL_RANK": str(rank),
                })
            processes.append(subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                              text=True, env=environment))
        outputs = [process.communicate() for process in processes]
    results = []
    for rank, (process, (stdout, stderr)) in enumerate(zip(processes, outputs)):
        if process.returncode != 0:
            print(stderr[-2000:], file=sys.stderr)
            raise RuntimeError(f"the {kind} run failed on rank {rank} of {rank_count} (exit {process.returncode}; "
                               "-9 is the kernel's out-of-memory killer)")
        results.append(json.loads(stdout.strip().splitlines()[-1]))
    run = results[0]
    run["peak_rss_mb"] = max(result["peak_rss_mb"] for result in results)
    run["tokens_computed"] = sum(result["tokens_computed"] for result in results)
    if run["peak_cuda_mb"] is not None:
        run["peak_cuda_mb"] = max(result["peak_cuda_mb"] for result in results)
    return run


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
