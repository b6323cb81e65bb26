"""Progress of a long job over files, through `rich`: a live bar on a terminal, plain lines elsewhere.

A CI log or a file gets no cursor movement: one line each time another tenth of the bytes is done,
so the log stays readable and still shows that the job moves.
"""

from __future__ import annotations

import sys
from types import TracebackType

from rich.console import Console
from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeElapsedColumn,
                           TimeRemainingColumn, TransferSpeedColumn)


class FileProgress:
    """Bytes of input done out of `total`, over `files` files; `advance(n)` after each file."""

    def __init__(self, total: int, files: int, enabled: bool = True, label: str = "encoding") -> None:
        self.total, self.files, self.label = max(total, 1), files, label
        self.done = self.files_done = 0
        self.console = Console(stderr=True)
        self.enabled = enabled and files > 0
        self._live = self.enabled and self.console.is_terminal
        self._next_line = 0.1
        self._progress: Progress | None = None

    def __enter__(self) -> "FileProgress":
        if self._live:
            self._progress = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                                      TransferSpeedColumn(), TextColumn("{task.fields[files]}"),
                                      TimeElapsedColumn(), TimeRemainingColumn(), console=self.console)
            self._progress.start()
            self._task = self._progress.add_task(self.label, total=self.total, files=f"0/{self.files} files")
        return self

    def advance(self, nbytes: int) -> None:
        self.done += nbytes
        self.files_done += 1
        if not self.enabled:
            return
        if self._progress is not None:
            self._progress.update(self._task, advance=nbytes, files=f"{self.files_done}/{self.files} files")
        elif self.done / self.total >= self._next_line or self.files_done == self.files:
            print(f"{self.label}: {self.files_done}/{self.files} files, {self.done / 2**20:.1f} of "
                  f"{self.total / 2**20:.1f} MiB ({self.done / self.total:.0%})", file=sys.stderr, flush=True)
            while self._next_line <= self.done / self.total:
                self._next_line += 0.1

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._progress is not None:
            self._progress.stop()
