"""Progress on stderr for ``ps-mcore analyze`` (no dependency).

On a terminal: one live status line with a bar, redrawn at most 10 times a second and erased
when the step ends. Otherwise (a log file, a pipe, CI): nothing for short steps, then one plain
line every 10 s, so a long run still shows it is alive without flooding the log. ``quiet``
prints nothing.
"""

from __future__ import annotations

import sys
import time
from typing import Callable, TextIO

TTY_INTERVAL_S = 0.1
LOG_INTERVAL_S = 10.0
BAR_WIDTH = 24


class Progress:
    """Factory of :class:`Step` s sharing one stream and one output policy."""

    def __init__(self, stream: TextIO | None = None, quiet: bool = False,
                 clock: Callable[[], float] = time.monotonic):
        self.stream = sys.stderr if stream is None else stream
        self.quiet = quiet
        self.clock = clock
        isatty = getattr(self.stream, "isatty", None)
        self.tty = bool(isatty and isatty())

    def step(self, label: str, total: int, unit: str) -> "Step":
        """A step of ``total`` ``unit`` (e.g. bytes, rows, micro-batches); use as a context
        manager, call :meth:`Step.advance` as work is done."""
        return Step(self, label, total, unit)


class Step:
    def __init__(self, owner: Progress, label: str, total: int, unit: str):
        self.owner, self.label, self.total, self.unit = owner, label, max(int(total), 0), unit
        self.done = 0
        self.start = owner.clock()
        self.next_draw = self.start + (TTY_INTERVAL_S if owner.tty else LOG_INTERVAL_S)
        self.drawn = 0  # width of the live line on a terminal

    def __enter__(self) -> "Step":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def advance(self, n: int = 1) -> None:
        self.done += n
        if self.owner.quiet:
            return
        now = self.owner.clock()
        if now < self.next_draw:
            return
        self.next_draw = now + (TTY_INTERVAL_S if self.owner.tty else LOG_INTERVAL_S)
        self._draw(now)

    def text(self, now: float) -> str:
        frac = self.done / self.total if self.total else 1.0
        count = (_human(self.done) + "/" + _human(self.total) if self.unit == "bytes"
                 else f"{self.done:,}/{self.total:,} {self.unit}")
        return f"{self.label}: {count} ({100 * min(frac, 1.0):.0f}%), {now - self.start:.0f} s"

    def _draw(self, now: float) -> None:
        stream = self.owner.stream
        if self.owner.tty:
            frac = min(self.done / self.total, 1.0) if self.total else 1.0
            filled = int(round(frac * BAR_WIDTH))
            line = f"[{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {self.text(now)}"
            stream.write("\r" + line.ljust(self.drawn))
            self.drawn = max(self.drawn, len(line))
        else:
            stream.write(f"ps-mcore analyze: {self.text(now)}\n")
        stream.flush()

    def close(self) -> None:
        if self.drawn:  # erase the live line; the report follows on stdout
            self.owner.stream.write("\r" + " " * self.drawn + "\r")
            self.owner.stream.flush()
            self.drawn = 0


def _human(nbytes: int) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if nbytes < 1000 or unit == "GB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1000
    return str(nbytes)


QUIET = Progress(quiet=True)
