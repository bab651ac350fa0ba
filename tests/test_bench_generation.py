"""`longhorizon bench generation`: its arithmetic, arguments, and real runs of the hf and scripted engines."""

import json

import pytest

from longhorizon.launch.bench.cli import main as bench_main
from longhorizon.launch.bench.generation import (
    MODEL_SHAPES,
    logprob_mismatch,
    main,
    throughput,
    write_shaped_model_folder,
)


def test_logprob_mismatch_over_all_tokens():
    figures = logprob_mismatch([[-1.0, -2.0], [-0.5]], [[-1.1, -2.0], [-0.25]])
    assert figures["tokens"] == 3
    assert figures["max_abs_diff"] == pytest.approx(0.25)
    assert figures["mean_abs_diff"] == pytest.approx((0.1 + 0.0 + 0.25) / 3)
    assert logprob_mismatch([], [])["tokens"] == 0
    with pytest.raises(ValueError):
        logprob_mismatch([[-1.0]], [[-1.0, -2.0]])


def test_throughput():
    assert throughput(120, 2.0) == 60.0
    assert throughput(5, 0.0) == 0.0


@pytest.mark.parametrize(
    "arguments, complaint",
    [
        (["--engine", "nonsense"], "unknown engine 'nonsense'"),
        (["--batch-sizes", "0"], "at least 1"),
        (["--batch-sizes", "a,b"], "comma-separated"),
        (["--new-tokens", "0"], "--new-tokens"),
        (["--engine", "hf", "--model-shape", "qwen2.5-1.5b"], "through vLLM only"),
    ],
)
def test_bad_arguments_are_a_clear_error(arguments, complaint, capsys):
    assert main(arguments) == 2
    assert complaint in capsys.readouterr().err


def _last_json(output: str) -> dict:
    return json.loads(output.strip().splitlines()[-1])


def test_hf_engine_run_prints_a_table_then_json(tiny_codebook_model, capsys):
    arguments = [
        "generation", "--engine", "hf", "--model", str(tiny_codebook_model), "--batch-sizes", "1,3",
        "--new-tokens", "4", "--updates", "1", "--logprob-check",
    ]
    assert bench_main(arguments) == 0  # through the `longhorizon bench` dispatcher
    output = capsys.readouterr().out
    assert "tokens/s" in output and "update inline s" in output
    result = _last_json(output)
    assert result["settings"]["batch_sizes"] == [1, 3]
    (engine,) = result["engines"]
    assert engine["engine"] == "hf" and engine["start_seconds"] > 0
    assert [row["batch_size"] for row in engine["batches"]] == [1, 3]
    for row in engine["batches"]:
        assert row["batch_size"] <= row["tokens"] <= 4 * row["batch_size"]
        assert row["tokens_per_s"] == pytest.approx(row["tokens"] / row["seconds"])
    assert engine["weight_update_seconds"]["inline"] > 0 and engine["weight_update_seconds"]["path"] > 0
    mismatch = engine["logprob_mismatch"]
    assert mismatch["tokens"] >= 3 and mismatch["max_abs_diff"] < 1e-4
    assert engine["memory_gib"] > 0


def test_scripted_engine_needs_no_model(capsys):
    assert main(["--engine", "scripted", "--batch-sizes", "2", "--new-tokens", "8"]) == 0
    (engine,) = _last_json(capsys.readouterr().out)["engines"]
    assert engine["batches"][0]["tokens"] > 0
    assert engine["weight_update_seconds"] == {"inline": None, "path": None}


def test_shaped_model_folder_has_the_architecture_and_a_tokenizer(tiny_codebook_model, tmp_path):
    folder = write_shaped_model_folder("qwen2.5-1.5b", tmp_path / "shape", tiny_codebook_model)
    config = json.loads((folder / "config.json").read_text())
    assert config["hidden_size"] == MODEL_SHAPES["qwen2.5-1.5b"]["hidden_size"]
    assert config["num_hidden_layers"] == 28
    assert (folder / "tokenizer.json").is_file()
    assert not list(folder.glob("*.safetensors"))
    with pytest.raises(ValueError, match="unknown model shape"):
        write_shaped_model_folder("gpt-5", tmp_path / "other", tiny_codebook_model)
