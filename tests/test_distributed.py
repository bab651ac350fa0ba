"""The multi-rank learner on CPU: gloo ranks in real processes, FSDP2 sharding, sharded checkpoints.

Two ranks must train exactly as one (the same parameters after two optimiser steps with a
proximal pass), a rank with nothing to do must still keep step with the others, and a checkpoint
written by two ranks must resume at one.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from longhorizon.common.config import ConfigError, LearnerConfig, load_config
from longhorizon.learner.distributed import Ranks, RanksError, ranks_from_environment, split_by_tokens
from longhorizon.learner.scoring import FlatShare

CONFIG = dict(optimizer_steps_per_batch=2, learning_rate=1e-3, micro_batch_size=2)


# -- pure parts ---------------------------------------------------------------------------------

def test_split_by_tokens_balances_longest_first():
    # Lengths 9, 7, 6, 5, 3: 9 -> rank 0; 7 -> rank 1; 6 -> rank 1 (7 < 9); 5 -> rank 0 (9 < 13);
    # 3 -> rank 0 (14 > 13? no: rank 1 has 13, rank 0 has 14) -> rank 1.
    assert split_by_tokens([5, 9, 3, 7, 6], 2) == [[0, 1], [2, 3, 4]]
    assert split_by_tokens([4, 4, 4, 4], 2) == [[0, 2], [1, 3]]
    assert split_by_tokens([10], 3) == [[0], [], []]
    assert split_by_tokens([], 2) == [[], []]
    with pytest.raises(ValueError):
        split_by_tokens([1], 0)


def test_split_by_tokens_is_within_one_sequence_of_even():
    rng = np.random.default_rng(3)
    for _ in range(200):
        lengths = [int(x) for x in rng.integers(1, 400, size=int(rng.integers(1, 40)))]
        parts = int(rng.integers(1, 6))
        shares = split_by_tokens(lengths, parts)
        assert sorted(i for share in shares for i in share) == list(range(len(lengths)))
        loads = [sum(lengths[i] for i in share) for share in shares]
        assert max(loads) <= sum(lengths) / parts + max(lengths)


def test_ranks_come_from_the_environment_and_must_match_the_config():
    assert ranks_from_environment(1, {}) == Ranks.single()
    assert ranks_from_environment(2, {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1"}) == Ranks(1, 2, 1)
    with pytest.raises(RanksError, match="torchrun --nproc-per-node 2"):
        ranks_from_environment(2, {})
    with pytest.raises(RanksError, match="learner.num_ranks=4"):
        ranks_from_environment(2, {"WORLD_SIZE": "4", "RANK": "0"})
    with pytest.raises(RanksError, match="outside"):
        ranks_from_environment(2, {"WORLD_SIZE": "2", "RANK": "2"})


def test_a_rank_that_is_done_exits_with_its_code_and_its_output_flushed(tmp_path):
    """`exit_without_teardown` skips the interpreter's teardown (where a collective's thread could
    abort the process) but loses nothing written before it: buffered stdout, a log file."""
    import subprocess
    import sys

    # Both held in buffers when the exit comes: stdout to a pipe, and the log record in a
    # MemoryHandler that writes to its file only when flushed.
    script = (
        "import logging, logging.handlers\n"
        f"file = logging.FileHandler({str(tmp_path / 'rank.log')!r})\n"
        "buffered = logging.handlers.MemoryHandler(100, logging.CRITICAL, file)\n"
        "logging.basicConfig(level=logging.INFO, handlers=[buffered])\n"
        "logging.getLogger('rank').info('final checkpoint written')\n"
        "print('metrics', end='')\n"
        "from longhorizon.learner.distributed import exit_without_teardown\n"
        "exit_without_teardown(3)\n"
        "print('never')\n"
    )
    environment = {key: value for key, value in os.environ.items() if key != "PYTHONUNBUFFERED"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=environment)
    assert done.returncode == 3, done.stderr
    assert done.stdout == "metrics"
    assert "final checkpoint written" in (tmp_path / "rank.log").read_text()


def test_wrong_rank_settings_fail_before_any_process_starts():
    from longhorizon.launch.checks import _check_learner_ranks, validate_config

    with pytest.raises(ConfigError, match="learner.num_ranks must be >= 1, got 0"):
        validate_config(load_config(None, ["learner.num_ranks=0", "env.name='codebook'", "actor.engine='scripted'"]))
    config = load_config(None, ["learner.num_ranks=2"])
    visible = torch.cuda.device_count()
    with pytest.raises(ConfigError, match=f"only {visible} CUDA GPU"):
        _check_learner_ranks(load_config(None, [f"learner.num_ranks={max(2, visible + 1)}"]), torch.device("cuda"))
    with pytest.raises(ConfigError, match="names one GPU"):
        _check_learner_ranks(load_config(None, ["learner.num_ranks=2", "learner.device='cuda:0'"]), torch.device("cuda", 0))
    _check_learner_ranks(config, torch.device("cpu"))  # gloo ranks share the CPU


# -- ranks in processes -------------------------------------------------------------------------

def _examples(lengths=(9, 14, 6, 11, 7), vocabulary=15, seed=0):
    from longhorizon.learner.logprobs import Example

    rng = np.random.default_rng(seed)
    examples = []
    for length in lengths:
        mask = np.zeros(length, np.float32)
        mask[3:] = 1
        examples.append(Example(
            token_ids=rng.integers(2, vocabulary, size=length),
            loss_mask=mask,
            behaviour_logprobs=(rng.normal(-2.5, 0.3, length) * mask).astype(np.float32),
            advantage=float(rng.normal()),
            token_rewards=np.where(np.arange(length) == length - 1, rng.random(), 0.0).astype(np.float32),  # ppo
        ))
    return examples


LORA = {"lora": {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "up_proj"]}}


def _trainer(model_folder, ranks, settings=None, float64=False):
    """A trainer on CONFIG, with `settings` (learner keys) on top; `float64`: the model in double
    precision."""
    from longhorizon.common.models import load_causal_lm
    from longhorizon.learner.trainer import Trainer

    torch.manual_seed(0)
    model = load_causal_lm(model_folder)
    if float64:
        model = model.double()
    return Trainer(model, LearnerConfig(**{**CONFIG, **(settings or {})}), ranks=ranks)


def _grouped_examples(seed=1):
    """Three groups (4, 3 and 2 members) each sharing a prompt of 17 to 19 tokens, then replies of
    2 to 8 tokens, and two examples without a group (48 and 9 tokens)."""
    from longhorizon.learner.logprobs import Example

    rng = np.random.default_rng(seed)

    def example(prompt, reply, group):
        tokens = np.concatenate([prompt, reply]).astype(np.int64)
        mask = np.r_[np.zeros(len(prompt)), np.ones(len(reply))].astype(np.float32)
        return Example(
            token_ids=tokens, loss_mask=mask,
            behaviour_logprobs=(rng.normal(-2.5, 0.3, len(tokens)) * mask).astype(np.float32),
            advantage=float(rng.normal()),
            token_rewards=np.where(np.arange(len(tokens)) == len(tokens) - 1, rng.random(), 0.0).astype(np.float32),
            group=group,
        )

    examples = []
    for group, size in enumerate((4, 3, 2)):
        prompt = rng.integers(2, 15, size=17 + group)
        examples += [example(prompt, rng.integers(2, 15, size=int(rng.integers(2, 9))), group) for _ in range(size)]
    examples += [example(rng.integers(2, 15, size=3), rng.integers(2, 15, size=length), None) for length in (45, 6)]
    return examples


def _gradients(trainer) -> dict[str, torch.Tensor]:
    """Every trained parameter's gradient, whole (a collective with several ranks: each rank holds
    a shard)."""
    gradients = {}
    for name, parameter in trainer.policy.named_parameters():
        if parameter.requires_grad:
            grad = parameter.grad if parameter.grad is not None else torch.zeros_like(parameter)
            gradients[name] = (grad.full_tensor() if hasattr(grad, "full_tensor") else grad).detach().clone()
    return gradients


def _rank_main(rank, world_size, port, model_folder, jobs):
    """One rank, running `jobs` one after the other in one process group (see `two_ranks`)."""
    from longhorizon.learner.distributed import destroy_process_group, exit_without_teardown, init_process_group

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    ranks = Ranks(rank, world_size, rank)
    init_process_group(ranks, torch.device("cpu"), timeout_s=120)
    try:
        torch.set_num_threads(1)
        for job in jobs:
            _rank_job(ranks, model_folder, **job)
    finally:
        destroy_process_group()
    exit_without_teardown(0)


def _rank_job(ranks, model_folder, out_dir, lengths=(9, 14, 6, 11, 7), checkpoint=False, settings=None,
              flat=(0.0, 0), grouped=False):
    """One job on one rank, with a trainer of its own: a step on the rank's share of the examples,
    then the gathered weights (and optionally a sharded checkpoint), saved by rank 0 for the test
    to compare. `grouped`: the examples of `_grouped_examples` in double precision, dealt as the
    learner deals them (`deal_examples`), and the gradients gathered too."""
    from longhorizon.learner.checkpoint import save_checkpoint
    from longhorizon.learner.curriculum import HorizonState

    trainer = _trainer(model_folder, ranks, settings, float64=grouped)
    if grouped:
        mine = trainer.deal_examples(_grouped_examples())[ranks.rank]
    else:
        examples = _examples(lengths)
        shares = split_by_tokens([len(e.token_ids) for e in examples], ranks.world_size)
        mine = [examples[i] for i in shares[ranks.rank]]
    metrics = trainer.step(mine, FlatShare(*flat))
    gradients = _gradients(trainer) if grouped else {}
    state = trainer.full_state_dict()
    sent = trainer.actor_weights()
    if checkpoint:
        save_checkpoint(out_dir, trainer=trainer, step=1, version=1, horizon=HorizonState(cap=3, stage=0, step=1),
                        counters={}, model_folder=model_folder)
    if ranks.is_main:
        torch.save({"state": state, "sent": sent, "metrics": metrics, "gradients": gradients,
                    "shared_prefix": trainer.shared_prefix}, os.path.join(out_dir, "ranks.pt"))
    else:
        assert state == {} and sent == {}  # only rank 0 receives the gathered weights


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _run_ranks(world_size, model_folder, jobs: list[dict]) -> None:
    """Two (`world_size`) rank processes that run `jobs` (`_rank_job`'s keywords, each with its
    own `out_dir`) in order."""
    mp.spawn(_rank_main, args=(world_size, _free_port(), str(model_folder), jobs), nprocs=world_size, join=True)


EXACT_SETTINGS = {
    "grpo": {}, "grpo-flat-groups": {}, "grpo-entropy-bonus": {"entropy_coef": 0.05},
    "grpo-target-entropy": {"entropy_control": "target", "target_entropy": 9.0, "entropy_coef": 0.05},
    "grpo-clip-cov": {"entropy_control": "clip_cov", "cov_fraction": 1.0, "clip_cov_low": 0.0, "clip_cov_high": 1e9},
    "grpo-kl-cov": {"entropy_control": "kl_cov", "cov_fraction": 1.0},
    "ppo": {"algorithm": "ppo", "advantage_std_scaling": True},
    "ppo-separate-critic": {"algorithm": "ppo", "critic": None},  # the critic is the model folder
}
EXACT_FLAT_SHARE = {"grpo-flat-groups": (30.0, 4)}
"""The flat groups' share of the step (`FlatShare`) where a case has one; (0.0, 0) otherwise."""
SHARED_PREFIX_CASES = {"grpo": ("grpo", False), "grpo-lora": ("grpo", True), "gspo": ("gspo", False),
                       "ppo": ("ppo", False), "ppo-lora": ("ppo", True)}


def _exact_settings(case: str, model_folder) -> dict:
    settings = dict(EXACT_SETTINGS[case])
    if "critic" in settings:
        settings["critic"] = str(model_folder)
    return settings


def _shared_prefix_settings(case: str) -> dict:
    algorithm, lora = SHARED_PREFIX_CASES[case]
    return {"algorithm": algorithm, "micro_batch_size": 3, **(LORA if lora else {})}


def _two_rank_jobs(model_folder) -> dict[str, dict]:
    """Every two-rank run this module compares with one rank, by the name of its test and case."""
    jobs = {f"exact/{case}": {"settings": _exact_settings(case, model_folder),
                              "flat": EXACT_FLAT_SHARE.get(case, (0.0, 0))}
            for case in EXACT_SETTINGS}
    jobs["lora"] = {"settings": LORA}
    jobs |= {f"shared-prefix/{case}": {"settings": {**_shared_prefix_settings(case), "shared_prefix": True},
                                       "grouped": True}
             for case in SHARED_PREFIX_CASES}
    jobs |= {f"idle-rank/{algorithm}": {"lengths": (12,), "settings": {"algorithm": algorithm}}
             for algorithm in ("grpo", "ppo")}
    jobs |= {f"checkpoint/{case}": {"checkpoint": True, "settings": lora}
             for case, lora in (("full", None), ("lora", LORA))}
    return jobs


_JOB_OF_TEST = {
    "test_two_ranks_train_exactly_as_one": "exact", "test_two_ranks_train_lora_adapters_exactly_as_one": "lora",
    "test_two_ranks_with_the_shared_prefix_train_exactly_as_one_without": "shared-prefix",
    "test_a_rank_without_examples_keeps_step_with_the_others": "idle-rank",
    "test_a_checkpoint_written_by_two_ranks_resumes_at_one": "checkpoint",
}


def _job_name(item) -> str | None:
    kind = _JOB_OF_TEST.get(getattr(item, "originalname", item.name))
    if kind is None or Path(str(item.path)) != Path(__file__):
        return None
    case = getattr(getattr(item, "callspec", None), "id", None)
    return f"{kind}/{case}" if case else kind


@pytest.fixture(scope="module")
def two_ranks(request, tiny_codebook_model, tmp_path_factory):
    """The two-rank side of this module's comparisons, every run of the selected tests in one
    pair of rank processes: starting two processes that import torch and transformers costs
    more than a run's step. Returns name -> (rank 0's results, the run's folder)."""
    jobs = _two_rank_jobs(tiny_codebook_model)
    selected = {_job_name(item) for item in request.session.items}
    folders = {name: tmp_path_factory.mktemp(name.replace("/", "-")) for name in jobs if name in selected}
    _run_ranks(2, tiny_codebook_model, [{**jobs[name], "out_dir": str(folder)} for name, folder in folders.items()])
    return {name: (torch.load(folder / "ranks.pt"), folder) for name, folder in folders.items()}


def _relative_error(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b)
    difference = sum(float((a[k].float() - b[k].float()).norm() ** 2) for k in a) ** 0.5
    return difference / sum(float(a[k].float().norm() ** 2) for k in a) ** 0.5


@pytest.mark.parametrize("algorithm", list(EXACT_SETTINGS))
def test_two_ranks_train_exactly_as_one(tiny_codebook_model, two_ranks, algorithm):
    """fp32, decoupled PPO with a separate proximal pass (two optimiser steps on one batch); for
    ppo, the critic too (its GAE advantages centred, and for "ppo" also whitened, over both ranks'
    tokens), on the policy's backbone or as a separate model sharded like the policy; flat
    groups' share of the denominator is counted once, not once per rank; the entropy bonus's
    full-distribution entropy is computed on each rank's positions like the log-probs, and the
    target mode's coefficient adapts to the entropy of both ranks' tokens; Clip-Cov and KL-Cov
    centre their covariance over both ranks' tokens (with every token in the band, or every
    token penalised, each rank's share of the choice is the whole batch's)."""
    one = _trainer(tiny_codebook_model, Ranks.single(), _exact_settings(algorithm, tiny_codebook_model))
    before = {k: v.clone() for k, v in one.full_state_dict().items()}
    one_metrics = one.step(_examples(), FlatShare(*EXACT_FLAT_SHARE.get(algorithm, (0.0, 0))))
    after_one = one.full_state_dict()
    two, _ = two_ranks[f"exact/{algorithm}"]

    assert _relative_error(after_one, before) > 1e-3  # the step moved the weights
    assert _relative_error(after_one, two["state"]) <= 1e-5
    names = ["loss", "train_tokens", "train_sequences", "grad_norm", "ratio_max", "clip_fraction"]
    extra = {"ppo": ["value_loss"], "ppo-separate-critic": ["value_loss"], "grpo-entropy-bonus": ["entropy"],
             "grpo-target-entropy": ["entropy", "entropy_coef"], "grpo-clip-cov": ["cov_clipped_fraction"],
             "grpo-kl-cov": ["cov_penalised_fraction", "kl_cov_penalty"]}.get(algorithm, [])
    for name in names + extra:
        assert two["metrics"][name] == pytest.approx(one_metrics[name], rel=1e-4, abs=1e-6), name


def test_two_ranks_train_lora_adapters_exactly_as_one(tiny_codebook_model, two_ranks):
    """With learner.lora the ranks shard base and adapters alike; after two optimiser steps the
    adapters sent to actors and the merged model exported are the one-rank ones."""
    one = _trainer(tiny_codebook_model, Ranks.single(), LORA)
    before = {k: v.clone() for k, v in one.actor_weights().items()}
    one.step(_examples())
    two, _ = two_ranks["lora"]

    sent = one.actor_weights()
    assert sorted(sent) == sorted(two["sent"]) and all(".lora_" in name for name in sent)
    assert _relative_error(sent, before) > 1e-3  # the adapters trained
    assert _relative_error(sent, two["sent"]) <= 1e-5
    assert _relative_error(one.full_state_dict(), two["state"]) <= 1e-5


def test_the_learner_deals_a_step_in_pieces_that_keep_a_shared_prefix():
    """How `_grouped_examples` is dealt to two ranks (micro-batches of 3 at most): each of group
    0's two micro-batches goes to another rank, and the ranks get different numbers of micro-batches
    with a shared prefix (1 and 3) and without (1 and 0), so the next test's ranks top up both runs
    with idle micro-batches."""
    from longhorizon.learner.shared_prefix import plan_group_micro_batches, sharing_units

    examples = _grouped_examples()
    units = sharing_units(examples, 3, 4096)
    shares = split_by_tokens([load for _, load in units], 2)
    dealt = [[examples[i] for unit in share for i in units[unit][0]] for share in shares]
    assert sorted(id(e) for share in dealt for e in share) == sorted(id(e) for e in examples)
    assert {e.group for e in dealt[0]} & {e.group for e in dealt[1]} == {0}
    runs = []
    for share in dealt:
        plan = plan_group_micro_batches(share, 3, 4096)
        runs.append((sum(1 for _, prefix in plan if prefix), sum(1 for _, prefix in plan if not prefix)))
    assert runs == [(1, 1), (3, 0)]


def _assert_same_gradient(actual: torch.Tensor, expected: torch.Tensor, name: str) -> None:
    """Equal to 1e-5 of the gradient's own scale (RMSNorm computes in float32 even in a float64
    model: tests/test_shared_prefix.py)."""
    scale = float(expected.abs().max())
    difference = float((actual - expected).abs().max())
    assert difference <= 1e-5 * scale + 1e-12, f"{name}: differs by {difference:.3g} at a scale of {scale:.3g}"


@pytest.mark.parametrize("case", list(SHARED_PREFIX_CASES))
def test_two_ranks_with_the_shared_prefix_train_exactly_as_one_without(tiny_codebook_model, two_ranks, case):
    """float64, two optimiser steps with a proximal pass: the loss, every trained parameter's
    gradient (of the second pass) and the parameters after the step are the plain one-rank step's,
    to 1e-5. Each rank encodes its groups' prefixes once, FSDP2 gathering and reducing each layer
    once per call (prefix, then members), and the ranks' different numbers of shared and plain
    micro-batches are evened out with idle ones; ppo's critic (on the policy's backbone) runs the
    plain pass beside it."""
    algorithm, lora = SHARED_PREFIX_CASES[case]
    one = _trainer(tiny_codebook_model, Ranks.single(), {**_shared_prefix_settings(case), "shared_prefix": False},
                   float64=True)
    before = {k: v.clone() for k, v in one.full_state_dict().items()}
    one_metrics = one.step(_grouped_examples())
    one_gradients = _gradients(one)
    two, _ = two_ranks[f"shared-prefix/{case}"]

    assert two["shared_prefix"]
    names = ["loss", "train_tokens", "train_sequences", "grad_norm", "ratio_max"]
    for name in names + (["value_loss"] if algorithm == "ppo" else []):
        assert two["metrics"][name] == pytest.approx(one_metrics[name], rel=1e-5, abs=1e-9), name
    assert sorted(two["gradients"]) == sorted(one_gradients) and one_gradients
    assert all(".lora_" in name or "value_model.head" in name for name in one_gradients) == lora
    for name, gradient in one_gradients.items():
        _assert_same_gradient(two["gradients"][name], gradient, name)
    # The update itself (after - before) to 1e-5 of its size. Not entry by entry: Adam divides each
    # entry's gradient by its own magnitude, so an entry whose gradient is near 0 (of the order of
    # Adam's eps) turns the 1e-7 rounding of RMSNorm's float32 into a difference of about 1e-6 of
    # its update (one entry in thousands).
    after = one.full_state_dict()
    one_update = {name: after[name] - before[name] for name in before}
    two_update = {name: two["state"][name] - before[name] for name in before}
    assert _relative_error(after, before) > 1e-4  # the step moved the weights
    assert _relative_error(one_update, two_update) <= 1e-5


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_a_rank_without_examples_keeps_step_with_the_others(tiny_codebook_model, two_ranks, algorithm):
    """One example for two ranks: rank 1 runs idle passes (for ppo through the critic too) so rank
    0's gathers complete, and the result is the one-rank step's."""
    settings = {"algorithm": algorithm}
    one = _trainer(tiny_codebook_model, Ranks.single(), settings)
    one.step(_examples(lengths=(12,)))
    two, _ = two_ranks[f"idle-rank/{algorithm}"]
    assert _relative_error(one.full_state_dict(), two["state"]) <= 1e-5
    assert two["metrics"]["train_sequences"] == 1


@pytest.mark.parametrize("lora", [None, LORA], ids=["full", "lora"])
def test_a_checkpoint_written_by_two_ranks_resumes_at_one(tiny_codebook_model, two_ranks, lora):
    from safetensors.torch import load_file

    from longhorizon.learner.checkpoint import latest_checkpoint, load_checkpoint

    two, folder = two_ranks["checkpoint/lora" if lora else "checkpoint/full"]
    checkpoint = latest_checkpoint(folder)
    assert checkpoint is not None and (checkpoint / "sharded").is_dir()
    # The exported folder is the whole model, loadable by actors and eval as it is.
    exported = load_file(checkpoint / "model.safetensors")
    assert _relative_error(exported, two["state"]) == 0.0

    resumed = _trainer(tiny_codebook_model, Ranks.single(), lora)
    restored = load_checkpoint(checkpoint, trainer=resumed)
    assert restored["step"] == 1 and restored["version"] == 1
    assert _relative_error(resumed.full_state_dict(), two["state"]) == 0.0
    # The optimiser state came back too: a further step at one rank matches one rank trained
    # throughout.
    reference = _trainer(tiny_codebook_model, Ranks.single(), lora)
    reference.step(_examples())
    more = _examples(seed=1)
    reference.step(more)
    resumed.step(more)
    assert _relative_error(resumed.full_state_dict(), reference.full_state_dict()) <= 1e-5
