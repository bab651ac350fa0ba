"""scripts/frozen-policy end to end, on a short budget: the policy it makes is frozen on the wrong
answer for s0, and the RL run from it trains with the entropy bonus and reports the full entropy."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_the_script_freezes_s0_on_a1_then_trains_from_there(tmp_path):
    done = subprocess.run(
        # One actor process instead of the config's two: the script's phases are under test.
        [sys.executable, str(REPO_ROOT / "scripts" / "frozen-policy"), "--entropy-coef", "0.2", "--steps", "2",
         "--set", "actor.num_actors=1", "--output", str(tmp_path)],
        capture_output=True, text=True, timeout=600, cwd=REPO_ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    # Every held-out task without s0 is right and every one with it wrong: (3/4)^3 = 42% of the
    # sequences avoid s0, so greedy success sits near that, far from the oracle's 100%.
    assert 0.3 < summary["held_out_before"] < 0.6
    assert len(summary["training_success"]) == 2 and summary["entropy_key"] == "entropy"
    assert len(summary["entropy"]) == 2 and all(0 < value < 2.71 for value in summary["entropy"])
    wrong = [json.loads(line) for line in (tmp_path / "s0-answers-a1.jsonl").read_text().splitlines()]
    answers = {(m["content"], n["content"]) for c in wrong for m, n in zip(c["messages"], c["messages"][1:])
               if m["role"] == "user"}
    assert ("s0", "a1") in answers and not any(symbol == "s0" and action != "a1" for symbol, action in answers)
