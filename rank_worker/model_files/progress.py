"""A progress bar on stderr around a weight generator (stdout may carry a protocol; stderr is for people)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TypeVar

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

T = TypeVar("T")


class TensorProgress:
    """One bar counting tensors; `label()` names the file (shard) being read so a slow shard is visible."""

    def __init__(self, description: str, total: int) -> None:
        self._progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[file]}"),
            TimeElapsedColumn(),
            console=Console(stderr=True),
        )
        self._task = self._progress.add_task(description, total=total, file="")

    def track(self, items: Iterable[T]) -> Iterator[T]:
        """Yield `items`, advancing the bar after each; the bar stops even if the consumer stops early."""
        with self._progress:
            for item in items:
                yield item
                self._progress.advance(self._task)

    def label(self, file: str) -> None:
        self._progress.update(self._task, file=file)
