"""Scripted search-env policies: an oracle that issues the gold queries and answers, and a random one."""

from __future__ import annotations

import random
import re

from longhorizon.envs.base import Task

_WORD = re.compile(r"[A-Za-z][A-Za-z'-]+")


class OraclePolicy:
    """Searches each gold query in hop order (the question itself when a task has none), then answers.

    It reads the answer from the task's golden answers, so its success measures the env's plumbing;
    whether the gold passages are actually retrieved is measured separately (recall@k in the bench).
    """

    def __init__(self, **options: object):
        del options  # the env's options do not change what the oracle does
        self._replies: list[str] = []
        self._next = 0

    def reset(self, task: Task, first_observation: str, rng: random.Random) -> None:
        queries = list(task.data.get("gold_queries") or [task.data["question"]])
        answer = str(task.data["golden_answers"][0])
        self._replies = [f"<think> Hop {hop}: I look up {query}. </think>\n<search> {query} </search>"
                         for hop, query in enumerate(queries, 1)]
        self._replies.append(f"<think> I have what I need. </think>\n<answer> {answer} </answer>")
        self._next = 0

    def act(self, observation: str) -> str:
        reply = self._replies[min(self._next, len(self._replies) - 1)]
        self._next += 1
        return reply


class RandomPolicy:
    """Searches, answers and (when enabled) computes with words picked at random from what it has seen."""

    def __init__(self, *, python_tool: bool = False, **options: object):
        del options
        self.python_tool = bool(python_tool)
        self._rng = random.Random(0)
        self._words: list[str] = []

    def reset(self, task: Task, first_observation: str, rng: random.Random) -> None:
        self._rng = rng
        self._words = _WORD.findall(first_observation) or ["question"]

    def act(self, observation: str) -> str:
        seen = _WORD.findall(observation)
        words = seen or self._words
        draw = self._rng.random()
        if draw < 0.5:
            query = " ".join(self._rng.choice(self._words + words) for _ in range(self._rng.randint(1, 3)))
            return f"<think> Let me search. </think>\n<search> {query} </search>"
        if draw < 0.75:
            answer = " ".join(self._rng.choice(words) for _ in range(self._rng.randint(1, 2)))
            return f"<answer> {answer} </answer>"
        if draw < 0.85 and self.python_tool:
            return f"<python>\nprint({self._rng.randint(1, 99)} * {self._rng.randint(1, 99)})\n</python>"
        return "I am not sure what to do next."
