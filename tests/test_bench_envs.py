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


def test_percentile_is_nearest_rank():
    from longhorizon.launch.bench.env_service import percentile

    values = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert percentile(values, 0.5) == 3.0  # rank ceil(2.5) = 3 of 1..5
    assert percentile(values, 0.99) == 5.0  # rank ceil(4.95) = 5
    assert percentile(values, 0.2) == 1.0  # rank 1
    assert percentile(list(range(1, 101)), 0.99) == 99  # rank 99 of 100
    assert percentile([], 0.5) != percentile([], 0.5)  # nan


def test_env_service_bench_measures_a_running_service_under_junk(capsys):
    from longhorizon.envs.server import EnvServer
    from longhorizon.envs.service import ServiceSettings

    with EnvServer(ServiceSettings("textcraft", header_timeout_s=0.5)) as server:
        arguments = [
            "env-service", "--server", f"svc={server.url}", "--seconds", "0.3", "--rounds", "1", "--junk", "20",
            "--attack-seconds", "1", "--ramp-seconds", "0.5", "--recover-seconds", "0", "--trickle-interval", "0.1",
        ]
        assert main(arguments) == 0
        assert len(server.service.instances) == 0  # the good clients closed theirs; the junk made none
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["svc_1_clients_requests_per_s"][0] > 0 and result["svc_8_clients_errors"] == 0
    attack = result["svc_attack"]
    assert attack["good_requests"] > 0 and attack["errors"] == 0 and attack["p99_ms"] >= attack["p50_ms"]
    assert attack["junk_connects"] >= 20 and attack["junk_cuts"] >= 10  # the tricklers met the header deadline


def test_env_service_bench_refuses_a_bad_server_argument(capsys):
    assert main(["env-service", "--server", "http://127.0.0.1:1"]) == 2
    assert "LABEL=URL" in capsys.readouterr().err


def test_process_cpu_seconds_counts_this_process_work():
    import os
    import time

    from longhorizon.launch.bench.env_service import process_cpu_seconds

    before = process_cpu_seconds(os.getpid())
    started = time.process_time()
    while time.process_time() - started < 0.3:
        pass
    assert 0.2 < process_cpu_seconds(os.getpid()) - before < 5
