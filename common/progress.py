"""A text progress bar for long commands (collect, sft): redrawn in place on a terminal, and a
plain line every tenth of the way when the output is a file or a pipe (logs stay readable)."""

from __future__ import annotations

import sys
import time
from typing import TextIO


def format_bar(done: int, total: int, *, width: int = 24) -> str:
    """`[#########...............]  37/100`: the share done, drawn in `width` characters."""
    total = max(total, 1)
    filled = min(width, int(width * done / total))
    return f"[{'#' * filled}{'.' * (width - filled)}] {done:>{len(str(total))}}/{total}"


class ProgressBar:
    """`update(done, detail)` as work finishes; `close()` at the end prints the last state."""

    def __init__(self, label: str, total: int, *, stream: TextIO | None = None) -> None:
        self.label = label
        self.total = total
        self.stream = stream if stream is not None else sys.stderr
        self.interactive = bool(getattr(self.stream, "isatty", lambda: False)())
        self.started = time.perf_counter()
        self._last_tenth = -1
        self._last_line = ""

    def _line(self, done: int, detail: str) -> str:
        elapsed = time.perf_counter() - self.started
        rate = done / elapsed if elapsed > 0 else 0.0
        return f"{self.label} {format_bar(done, self.total)} {detail} | {elapsed:.0f}s, {rate:.2f}/s".rstrip()

    def update(self, done: int, detail: str = "") -> None:
        line = self._line(done, detail)
        self._last_line = line
        if self.interactive:
            self.stream.write("\r" + line + "\x1b[K")
            self.stream.flush()
            return
        tenth = 10 * done // max(self.total, 1)
        if tenth > self._last_tenth:
            self._last_tenth = tenth
            self.stream.write(line + "\n")
            self.stream.flush()

    def close(self) -> None:
        if self.interactive and self._last_line:
            self.stream.write("\n")
            self.stream.flush()
