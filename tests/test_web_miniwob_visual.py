"""MiniWoB's picture types: offered with screenshots, each seed showing BrowserGym's problem for that seed."""

from __future__ import annotations

import struct

import pytest

from longhorizon.envs.base import Task, make_env
from longhorizon.envs.web.browser import BrowserPool
from longhorizon.envs.web.miniwob import VISUAL_TASKS
from tests.data.make_miniwob_seeds import OTHER_SEEDS, browsergym_pages

# The task's drawing area as markup (less the ids our env writes into the page) and the pixels of
# its canvases: two pages showing the same problem give the same string.
_PROBLEM_JS = """
() => {
  const area = document.querySelector('#area');
  if (!area) return '';
  const copy = area.cloneNode(true);
  copy.querySelectorAll('[data-bid]').forEach(element => element.removeAttribute('data-bid'));
  copy.removeAttribute('data-bid');
  const pixels = [...area.querySelectorAll('canvas')].map(canvas => canvas.toDataURL());
  return copy.innerHTML + '\\n' + pixels.join('\\n');
}
"""


async def _problem_on(session) -> str:
    return await session.page().evaluate(_PROBLEM_JS)


def _png_size(data: bytes) -> tuple[int, int]:
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


@pytest.mark.browser
@pytest.mark.slow
async def test_every_picture_type_shows_browsergyms_problem_for_the_seed_and_a_screenshot_of_it():
    """One seed a type, a train seed and a test seed in turn. The problem is compared as the
    drawing area's markup and its canvases' pixels, since many of these types say the same
    instruction whatever the seed ("Draw a circle centered around the marked point")."""
    import trio

    names = sorted(VISUAL_TASKS)
    cases = [(name, OTHER_SEEDS[index % 2]) for index, name in enumerate(names)]
    want = await trio.to_thread.run_sync(browsergym_pages, cases, _PROBLEM_JS)
    pool = BrowserPool(1)
    env = make_env("miniwob", task_names=names, observation_modes=["text", "screenshot"], screenshot_size=[320, 240],
                   pool=pool)
    try:
        got, screenshot_sizes = [], set()
        for name, seed in cases:
            task = Task(env_name="miniwob", task_id=f"seed-{name}-{seed}", split="train", category=name,
                        data={"task": name, "seed": seed})
            observation, info = await env.reset(task)
            problem = await env._episode.session.call(_problem_on, timeout_s=10.0)
            got.append((observation.splitlines()[0].removeprefix("Goal: "), problem))
            screenshot_sizes.add(_png_size(info["screenshot"]))
        mismatched = [(case, mine, theirs) for case, mine, theirs in zip(cases, got, want) if mine != theirs]
        assert not mismatched, mismatched
        assert all(problem for _, problem in got)  # every type draws into its area
        assert len(set(got)) == len(names)  # no two types show the same instruction and drawing
        assert screenshot_sizes == {(320, 240)}
    finally:
        await env.close()
        pool.close()
