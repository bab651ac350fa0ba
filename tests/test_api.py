"""The Python API (launch/api.py): the example of docs/api.md runs as written, errors come back as
exceptions, and `import longhorizon` stays light."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

import longhorizon as lh
from tests.test_bench import allocator_as_it_is

DOCS = Path(__file__).resolve().parent.parent / "docs" / "api.md"


def _examples() -> list[str]:
    return re.findall(r"```python\n(.*?)```", DOCS.read_text(), re.S)


def _run_example(code: str, tmp_path, monkeypatch) -> dict:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))  # the examples' scratch folders
    namespace: dict = {}
    exec(compile(code, str(DOCS), "exec"), namespace)
    return namespace


def test_the_docs_show_an_example_of_every_function():
    code = "".join(_examples())
    for name in ("train", "evaluate", "collect", "sft", "dpo", "rft", "report", "bench"):
        assert f"lh.{name}(" in code, name


@pytest.mark.slow
def test_the_training_example_in_the_docs_runs_as_written(tmp_path, monkeypatch, capsys):
    namespace = _run_example(_examples()[0], tmp_path, monkeypatch)
    run, scores = namespace["run"], namespace["scores"]
    assert isinstance(run, lh.TrainResult) and [r["step"] for r in run.records] == [1, 2, 3]
    assert run.latest_checkpoint == run.run_dir / "checkpoints" / "step_000003"
    assert scores["episodes"] == 8 and 0.0 <= scores["success_rate"] <= 1.0
    assert "held-out success" in capsys.readouterr().out


@pytest.mark.slow
def test_the_offline_example_in_the_docs_runs_as_written(tmp_path, monkeypatch, capsys):
    namespace = _run_example(_examples()[1], tmp_path, monkeypatch)
    oracle, tuned, pairs, kept = (namespace[name] for name in ("oracle", "tuned", "pairs", "kept"))
    assert (oracle.written, oracle.successful) == (128, 128)  # the oracle solves every task
    assert tuned["eval_before"]["success_rate"] < 0.5 < 0.9 <= tuned["eval_after"]["success_rate"]
    assert Path(tuned["checkpoint"]).is_dir() and Path(pairs["checkpoint"]).is_dir()
    assert pairs["pairs"] > 0 and kept["rounds"][0]["kept"] > 0
    assert Path(kept["rounds"][0]["checkpoint"]).is_dir()
    printed = capsys.readouterr().out
    assert "SFT: held-out" in printed and "DPO on" in printed and "RFT: kept" in printed


def test_the_benchmark_example_in_the_docs_runs_as_written(tmp_path, monkeypatch, capsys):
    namespace = _run_example(_examples()[2], tmp_path, monkeypatch)
    assert namespace["steps"]["codebook_in_process_steps"] > 0 and namespace["steps"]["codebook_http_steps"] > 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("env calls") and printed[-1].startswith("codebook: ")


def test_mistakes_come_back_as_the_exceptions_the_commands_print(capsys):
    with pytest.raises(lh.ConfigError, match="config file not found: nope"):
        lh.train("nope")
    with pytest.raises(lh.ConfigError, match="overrides go with a config's name or file"):
        lh.evaluate(lh.load_config("codebook"), ["run.seed=3"])
    with pytest.raises(lh.ConfigError, match="unknown config key run.no_such_key"):
        lh.train("codebook", ["run.no_such_key=1"])
    with pytest.raises(lh.RunFailed) as failed:
        lh.bench("no-such-benchmark")
    assert failed.value.exit_code == 2


def test_a_scripted_evaluation_and_a_benchmark_return_their_results(capsys):
    scores = lh.evaluate("codebook", ["actor.engine='scripted'"], tasks=5)
    assert scores["episodes"] == 5 and scores["success_rate"] == 1.0  # the oracle solves every task
    result = lh.bench("transport", "--trajectory-bytes", "2048", "--transport-messages", "200",
                      "--transport-rounds", "1", *allocator_as_it_is())
    assert "raw" in capsys.readouterr().out  # the table was shown
    assert isinstance(result, dict) and result


def test_an_evaluation_takes_a_config_object_and_checks_its_options(tmp_path):
    """A Config built in Python is evaluated as it is (no file written for it), a sweep returns its
    points, and an option that does not fit is a ValueError naming it."""
    config = lh.load_config("codebook", ["actor.engine='scripted'"])
    config = config.replace(run=config.run.replace(output_dir=str(tmp_path)))
    swept = lh.evaluate(config, tasks=4, sweep="horizon", values=[1, 3])
    assert [point["horizon_cap"] for point in swept["points"]] == [1, 3]
    # The oracle needs as many turns as the task's symbols: cap 1 fails what cap 3 solves.
    assert swept["points"][0]["success_rate"] < swept["points"][1]["success_rate"] == 1.0
    assert list(tmp_path.iterdir()) == []  # nothing written without output_dir
    with pytest.raises(ValueError, match="tasks must be >= 1, got 0"):
        lh.evaluate(config, tasks=0)
    with pytest.raises(ValueError, match="--k 4 needs at least that many samples per task"):
        lh.evaluate(config, tasks=2, k=[4])


def test_import_longhorizon_imports_nothing_heavy():
    code = "import sys, longhorizon; longhorizon.load_config; print(sorted({'torch', 'transformers', 'zmq'} & set(sys.modules)))"
    output = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert output.strip() == "[]"
