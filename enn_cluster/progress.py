"""A one-line progress bar on stderr for long client-side work (staging, collect).

Redrawn in place at most every `interval` seconds on a terminal; elsewhere (logs, CI,
captured output) it stays silent, so an error after it is still the only line.
"""
from __future__ import annotations

import sys
import time
from typing import Optional, TextIO


class ProgressBar:
    def __init__(self, label: str, total: int, unit: str = "B",
                 stream: Optional[TextIO] = None, interval: float = 0.25) -> None:
        self.label, self.total, self.unit = label, max(int(total), 0), unit
        self.stream = stream or sys.stderr
        self.interval, self.done = interval, 0
        self.started = self.last = time.perf_counter()
        self.live = bool(getattr(self.stream, "isatty", lambda: False)())

    def _size(self, n: float) -> str:
        if self.unit != "B":
            return f"{n:,.0f} {self.unit}"
        for suffix in ("B", "KiB", "MiB", "GiB", "TiB"):
            if n < 1024 or suffix == "TiB":
                return f"{n:.1f} {suffix}" if suffix != "B" else f"{n:.0f} B"
            n /= 1024
        return ""  # unreachable

    def line(self) -> str:
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        pct = 100.0 * self.done / self.total if self.total else 100.0
        width = 24
        filled = int(width * pct / 100)
        return (f"{self.label} [{'#' * filled}{'.' * (width - filled)}] {pct:5.1f}% "
                f"{self._size(self.done)}/{self._size(self.total)} "
                f"{self._size(self.done / elapsed)}/s")

    def update(self, n: int) -> None:
        self.done += n
        now = time.perf_counter()
        if self.live and now - self.last >= self.interval:
            self.last = now
            self.stream.write("\r" + self.line())
            self.stream.flush()

    def close(self) -> None:
        if self.live:
            self.stream.write("\r" + self.line() + "\n")
            self.stream.flush()
