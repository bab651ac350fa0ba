"""The env benchmark runs envs in-process and through the HTTP service and reports both."""

import json

from longhorizon.launch.bench.cli import main


def test_env_bench_reports_both_paths(capsys):
    assert main(["envs", "--env", "codebook", "--env-seconds", "0.3"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["envs"] == ["codebook"]
    assert result["codebook_in_process_steps"] > 0 and result["codebook_http_steps"] > 0
    assert result["codebook_http_ms_per_call"] > result["codebook_in_process_ms_per_call"]


def test_env_bench_unknown_env_is_a_clear_error(capsys):
    assert main(["envs", "--env", "nope", "--env-seconds", "0.1"]) == 2
    assert "unknown env 'nope'" in capsys.readouterr().err
