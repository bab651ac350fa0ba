"""`transcript`: an example longhorizon actor type that plays through another engine and records
every turn to a JSON Lines file."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any, Mapping

from longhorizon.actor.engines.base import EngineSettings, GenerationRequest, GenerationResult, make_engine

__all__ = ["TranscriptEngine"]

OPTION_DEFAULTS = {"inner": "scripted", "path": "transcript.jsonl"}


class TranscriptEngine:
    """Delegates generation and weight updates to an inner engine; appends one JSON line per turn."""

    needs_model = False
    """Only the inner engine may need a model; `longhorizon eval` need not insist on one."""

    def __init__(self, settings: EngineSettings, options: Mapping[str, Any] | None = None) -> None:
        chosen = {name: os.environ.get(f"LONGHORIZON_TRANSCRIPT_{name.upper()}", default)
                  for name, default in OPTION_DEFAULTS.items()}
        chosen.update(settings.engine_options)  # actor.engine_options
        chosen.update(options or {})
        unknown = sorted(set(chosen) - set(OPTION_DEFAULTS))
        if unknown:
            raise ValueError(f"unknown transcript engine option {unknown[0]!r}; valid: {', '.join(OPTION_DEFAULTS)}")
        if chosen["inner"] == "transcript":
            raise ValueError("the transcript engine cannot wrap itself; choose another inner engine")
        # The engine options were this engine's own; the inner engine gets none.
        self.inner = make_engine(str(chosen["inner"]), dataclasses.replace(settings, engine_options={}))
        self.tokenizer = self.inner.tokenizer  # conversations are built with the inner model's tokens
        self.path = Path(str(chosen["path"]))
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", encoding="utf-8")
        self._turns: dict[str, int] = {}

    @property
    def policy_version(self) -> int:
        return self.inner.policy_version

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        result = await self.inner.generate(request)
        turn = self._turns.get(request.episode_id, 0) + 1
        self._turns[request.episode_id] = turn
        observation = request.messages[-1]["content"] if request.messages else ""
        record = {
            "time": time.time(), "episode_id": request.episode_id, "turn": turn,
            "task_id": getattr(request.task, "task_id", None), "observation": observation,
            "reply": result.text, "tokens": len(result.token_ids), "policy_version": result.policy_version,
        }
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()  # a crashed run still leaves every finished turn on disk
        return result

    def update_weights(self, update: Any) -> None:
        self.inner.update_weights(update)

    def end_episode(self, episode_id: str) -> None:
        self._turns.pop(episode_id, None)
        self.inner.end_episode(episode_id)

    async def close(self) -> None:
        try:
            await self.inner.close()
        finally:
            self._file.close()
