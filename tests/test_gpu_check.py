"""scripts/gpu-check: runs on CPU where only torch and transformers are installed, from a checkout
under any folder name; its weight check catches a tensor that was not loaded; the real run on CUDA."""

import importlib.machinery
import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from longhorizon.common.models import load_causal_lm

REPO_ROOT = Path(__file__).resolve().parent.parent
SCRIPT = REPO_ROOT / "scripts" / "gpu-check"
ABSENT_ON_THE_GPU_MACHINE = ("zmq", "msgpack", "trio", "vllm", "peft")

BLOCKER = '''"""Imports of these modules fail here, as on a machine where they are not installed."""
import sys

for name in {names!r}:
    sys.modules[name] = None  # `import name` raises ModuleNotFoundError; find_spec says it is absent
'''


def _environment_without_network_packages(tmp_path: Path) -> dict[str, str]:
    folder = tmp_path / "blocker"
    folder.mkdir()
    (folder / "sitecustomize.py").write_text(BLOCKER.format(names=ABSENT_ON_THE_GPU_MACHINE))
    return dict(os.environ, PYTHONPATH=str(folder))


def _load_script(monkeypatch):
    """The script as a module (it has no .py name to import it by)."""
    loader = importlib.machinery.SourceFileLoader("gpu_check", str(SCRIPT))
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader("gpu_check", loader))
    monkeypatch.setitem(sys.modules, "gpu_check", module)  # its dataclasses look their module up
    loader.exec_module(module)
    return module


def test_the_script_is_an_executable_python_program():
    assert os.access(SCRIPT, os.X_OK)
    assert SCRIPT.read_text().startswith("#!/usr/bin/env python3\n")


def test_it_runs_on_cpu_without_the_network_packages_from_a_checkout_under_another_name(tmp_path):
    environment = _environment_without_network_packages(tmp_path)
    probe = "import importlib.util as u; print(sum(u.find_spec(n) is None for n in {names!r}))"
    blocked = subprocess.run([sys.executable, "-c", probe.format(names=ABSENT_ON_THE_GPU_MACHINE)],
                             env=environment, capture_output=True, text=True, timeout=60)
    assert blocked.stdout.strip() == str(len(ABSENT_ON_THE_GPU_MACHINE)), blocked.stderr  # all absent
    checkout = tmp_path / "checkout-under-another-name"
    shutil.copytree(REPO_ROOT, checkout, ignore=shutil.ignore_patterns(
        ".venv", ".cache", ".git", "runs", "__pycache__", "*.egg-info", ".pytest_cache", "tests",
    ))
    completed = subprocess.run(
        [sys.executable, "scripts/gpu-check", "--device", "cpu", "--tiny", "--steps", "1"],
        cwd=checkout, env=environment, capture_output=True, text=True, timeout=300,
    )
    assert completed.returncode == 0, completed.stdout[-2000:] + completed.stderr[-4000:]
    result = json.loads(completed.stdout.strip().splitlines()[-1])
    assert result["passed"] and result["device"] == "cpu"
    assert result["code"] == str(checkout.resolve())  # the copy's code, not the installed package
    assert sorted(result["stand_ins"]) == ["msgpack", "trio"]
    assert [run["precision"] for run in result["train"]] == ["bf16-mixed", "fp32"]
    for run in result["train"]:
        assert run["changed_tensors"] > 0
        assert len(run["losses"]) == 2 and all(math.isfinite(loss) for loss in run["losses"])
        assert run["tokens_per_s"] > 0 and run["peak_gpu_mb"] is None
    assert result["generation"]["generated_tokens"] > 0
    assert set(result["weights_update_s"]) == {"inline", "path"}


def test_the_weights_check_catches_weights_that_were_not_loaded(tiny_codebook_model, tmp_path, monkeypatch):
    gpu_check = _load_script(monkeypatch)
    args = gpu_check.parse_args(["--device", "cpu", "--tiny"])
    device = torch.device("cpu")
    engine = gpu_check.make_engine(tiny_codebook_model, device, args)
    learner_model = load_causal_lm(tiny_codebook_model)
    with torch.no_grad():
        for parameter in learner_model.parameters():
            parameter.add_(0.5)
    assert gpu_check.move_weights(learner_model, engine, "inline", 1, tmp_path) >= 0

    def take_the_version_but_not_the_weights(update):
        engine.policy_version = update.version

    engine.update_weights = take_the_version_but_not_the_weights
    with pytest.raises(gpu_check.CheckFailed, match="differs from the learner's"):
        gpu_check.move_weights(learner_model, engine, "path", 2, tmp_path)


@pytest.mark.parametrize("argv, message", [
    (["--model", "/no/such/model"], "no config.json"),
    (["--tiny", "--device", "tpu"], "device must be auto, cpu, cuda or cuda:N"),
])
def test_bad_options_are_refused_with_the_fix_and_no_traceback(argv, message):
    completed = subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, timeout=120)
    assert completed.returncode == 2
    assert message in completed.stderr and "Traceback" not in completed.stderr


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False here)")
def test_the_full_check_on_cuda():
    completed = subprocess.run([sys.executable, str(SCRIPT), "--device", "cuda"], cwd=REPO_ROOT,
                               capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0, completed.stdout[-2000:] + completed.stderr[-4000:]
    result = json.loads(completed.stdout.strip().splitlines()[-1])
    assert result["passed"] and result["gpu"]
    for run in result["train"]:
        assert run["peak_gpu_mb"] > 0 and run["tokens_per_s"] > 0 and run["tokens_per_step"] >= 8 * 1024
    assert result["generation"]["tokens_per_s"] > 0
    assert result["seconds"] < 8 * 60
