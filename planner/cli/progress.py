"""Progress bars for the command-line tools: the only tqdm import.

A bar (rate and ETA, from tqdm) is drawn on stderr only when stderr is a terminal; redirected to a
file or a pipe (a log, CI, a job scheduler), the tools write nothing for progress at all, so logs
hold no carriage-return noise. ``Progress`` is a context manager with two ways to feed it:
``update(n)`` for n more units, or calling it as ``progress(done, total)`` (the planner's
``make_plan(progress=...)`` callback), which also sets the total the first time.
"""

from __future__ import annotations

import os
import sys
from types import TracebackType
from typing import IO, Any

from tqdm import tqdm

__all__ = ["Progress", "interactive"]


def interactive(stream: IO[str] | None = None) -> bool:
    """True when ``stream`` (default stderr) is a terminal."""
    stream = sys.stderr if stream is None else stream
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # closed or file-like without isatty
        return False


class Progress:
    """A tqdm bar on stderr when it is a terminal and ``enabled``; otherwise it does nothing."""

    def __init__(self, desc: str, *, unit: str = "step", total: int | None = None,
                 enabled: bool = True, stream: IO[str] | None = None) -> None:
        self.stream = sys.stderr if stream is None else stream
        self.enabled = enabled and interactive(self.stream)
        self._desc, self._unit, self._total = desc, unit, total
        self._bar: Any = None

    def _ensure(self) -> Any:
        if self._bar is None:
            # A terminal that reports no size (some CI ptys, serial consoles) would get a bar
            # of width 0, and tqdm hides bars below the last row: assume 100 x 24.
            try:
                size = os.get_terminal_size(self.stream.fileno())
                cols, rows = size.columns, size.lines
            except (OSError, AttributeError, ValueError):
                cols = rows = 0
            sized = cols > 0 and rows > 0
            self._bar = tqdm(total=self._total, desc=self._desc, unit=self._unit,
                             file=self.stream, dynamic_ncols=sized,
                             ncols=None if sized else 100, nrows=None if sized else 24,
                             leave=True, mininterval=0.1, smoothing=0.1)
        return self._bar

    def __call__(self, done: int, total: int) -> None:
        """Callback form: ``done`` of ``total`` units are complete."""
        if not self.enabled:
            return
        if self._bar is None:
            self._total = total
        bar = self._ensure()
        if bar.total != total:
            bar.total = total
        bar.update(done - bar.n)

    def update(self, n: int = 1, **postfix: object) -> None:
        """``n`` more units done; ``postfix`` shows beside the bar (e.g. ``loss=2.31``)."""
        if not self.enabled:
            return
        bar = self._ensure()
        if postfix:
            bar.set_postfix(postfix, refresh=False)
        bar.update(n)

    def write(self, line: str, file: IO[str] | None = None) -> None:
        """Print a line (default stdout) without breaking the bar."""
        out = sys.stdout if file is None else file
        if self.enabled and self._bar is not None:
            tqdm.write(line, file=out)
        else:
            print(line, file=out, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
