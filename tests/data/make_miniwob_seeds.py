"""Writes tests/data/miniwob_seeds.json: the MiniWoB instructions BrowserGym shows for each (task, seed).

BrowserGym is not a dependency, so this replays its MiniWoB start-up on its own, without the env's
code: for reset(seed=s) its task makes numpy.random.RandomState(s), puts the generator's first
randint(0, 1_000_000) into the page source as a number literal (`Math.seedrandom(123456);`), sets
core.EPISODE_MAX_TIME, calls core.startEpisodeReal(), waits for WOB_TASK_READY and takes
core.getUtterance() (its "utterance" field when the page returns an object) as the goal. The pages
are the `miniwob` package's, which are the same files as the MiniWoB++ commit BrowserGym pins.
One browser, one page, loaded for each (task, seed): five seeds of seven types, then one seed of
every other text type: for a type with an oracle the test seed tests/test_web_miniwob_oracles.py
plays it on first (that test checks the instruction as it plays), for the rest a train seed and a
test seed in turn.

    .venv/bin/python tests/data/make_miniwob_seeds.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
from playwright.sync_api import sync_playwright

from longhorizon.envs.web.browser import CHROMIUM_ARGS, DEFAULT_CHROMIUM
from longhorizon.envs.web.miniwob import TEST_SEED_BASE, StaticServer, miniwob_html_dir

TASKS = ("click-button", "click-checkboxes", "enter-text", "choose-list", "click-link", "focus-text-2", "login-user")
# focus-text is left out: its instruction is the same for every seed.
# Train instances use seeds 0.., test instances seeds from 1_000_000 (miniwob.TEST_SEED_BASE).
SEEDS = (0, 1, 2, 1_000_000, 1_000_001)
# Every other text type once: an oracle type on the first test seed its oracle test plays, the
# rest a train seed and a test seed in turn.
OTHER_SEEDS = (0, 1_000_000)
ORACLE_TEST_SEEDS = (TEST_SEED_BASE, TEST_SEED_BASE + 1, TEST_SEED_BASE + 2)
# BrowserGym's defaults: a 500x320 viewport and a 1,000,000 ms episode.
VIEWPORT = {"width": 500, "height": 320}
EPISODE_MAX_TIME_MS = 1_000_000
OUTPUT = Path(__file__).with_name("miniwob_seeds.json")


def first_oracle_seed(name: str) -> int:
    """The test seed the oracle test plays type `name` on first: the three taken in turn across
    ORACLE_TASKS."""
    from longhorizon.envs.web.miniwob import ORACLE_TASKS

    return ORACLE_TEST_SEEDS[ORACLE_TASKS.index(name) % len(ORACLE_TEST_SEEDS)]


def recorded_cases() -> list[tuple[str, int]]:
    """The (task, seed) pairs the recording holds, in its order."""
    from longhorizon.envs.web.miniwob import ORACLE_TASKS, TASK_NAMES

    others = [name for name in TASK_NAMES if name not in TASKS and name != "focus-text"]
    without_oracle = [name for name in others if name not in ORACLE_TASKS]
    return ([(task, seed) for task in TASKS for seed in SEEDS]
            + [(name, first_oracle_seed(name) if name in ORACLE_TASKS else OTHER_SEEDS[without_oracle.index(name) % 2])
               for name in others])


def browsergym_page_seed(seed: int) -> int:
    return int(np.random.RandomState(seed).randint(0, 1_000_000))


def browsergym_pages(cases: list[tuple[str, int]], read_js: str | None = None) -> list[tuple[str, object]]:
    """For each (task, seed), the instruction BrowserGym's start-up shows (whitespace runs as one
    space, as the env's goal line has it) and what `read_js` evaluates to on the started page
    (None without it). One browser with BrowserGym's viewport, one page loaded for each case."""
    server = StaticServer(miniwob_html_dir())
    pages = []
    try:
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=DEFAULT_CHROMIUM, args=list(CHROMIUM_ARGS))
            try:
                page = browser.new_page(viewport=VIEWPORT)
                for task, seed in cases:
                    page.goto(f"{server.url}/miniwob/{task}.html")
                    page.evaluate(
                        f"Math.seedrandom({browsergym_page_seed(seed)});\n"
                        f"core.EPISODE_MAX_TIME = {EPISODE_MAX_TIME_MS};\n"
                        "core.startEpisodeReal();\n"
                    )
                    page.wait_for_function("() => WOB_TASK_READY")
                    utterance = page.evaluate("() => core.getUtterance()")
                    if isinstance(utterance, dict):
                        utterance = utterance["utterance"]
                    pages.append((" ".join(str(utterance).split()), page.evaluate(read_js) if read_js else None))
            finally:
                browser.close()
    finally:
        server.stop()
    return pages


def main() -> int:
    chosen = recorded_cases()
    records = [{"task": task, "seed": seed, "page_seed": browsergym_page_seed(seed), "instruction": instruction}
               for (task, seed), (instruction, _) in zip(chosen, browsergym_pages(chosen))]
    fixture = {
        "about": "MiniWoB instructions BrowserGym gives for reset(seed); written by tests/data/make_miniwob_seeds.py",
        "records": records,
    }
    OUTPUT.write_text(json.dumps(fixture, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"wrote {len(records)} instructions to {OUTPUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
