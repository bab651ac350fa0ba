"""`longhorizon bench gateway`: both paths measured at each concurrency, every session sent on."""

from longhorizon.launch.bench import gateway


def test_the_gateway_bench_measures_both_paths_at_each_concurrency(tiny_codebook_model, capsys):
    result = gateway.run(["--model", str(tiny_codebook_model), "--sessions", "1,3", "--calls", "2",
                          "--new-tokens", "2"])
    assert [row["sessions"] for row in result["rows"]] == [1, 3]
    assert [row["calls"] for row in result["rows"]] == [2, 6]
    assert all(row["direct_ms"] > 0 and row["gateway_ms"] > 0 for row in result["rows"])
    assert result["trajectories"] == 1 + 3  # every gateway session ended with its reward
    assert "overhead %" in capsys.readouterr().out
