"""Live progress for the long phases (``prove``, a conformance config, shrinking, ``mutants``).

On a terminal it is a transient status line (a spinner that disappears, so the tables and
logs stay as they were); written to a pipe or a file it is a plain line on **stderr** at
most every ``KVPROOF_PROGRESS_SECONDS`` (default 5) seconds, so a short phase prints
nothing and a log of stdout is unchanged.
"""

from __future__ import annotations

import os
import time
from types import TracebackType
from typing import Any

from rich.console import Console

__all__ = ["Progress"]


class Progress:
    """``update(text)`` as often as you like; shown as described in the module docstring."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.terminal = console.is_terminal
        self.err = Console(stderr=True, width=console.width, highlight=False)
        try:
            self.interval = float(os.environ.get("KVPROOF_PROGRESS_SECONDS", "5"))
        except ValueError:
            self.interval = 5.0
        self._last = time.monotonic()
        self._status: Any = None

    def update(self, text: str) -> None:
        if self.terminal:
            if self._status is None:
                self._status = self.console.status(text)
                self._status.start()
            else:
                self._status.update(text)
            return
        now = time.monotonic()
        if now - self._last >= self.interval:
            self._last = now
            self.err.print(f"... {text}", markup=False, soft_wrap=True)

    def stop(self) -> None:
        if self._status is not None:
            self._status.stop()
            self._status = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()
