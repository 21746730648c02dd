"""Progress told in planned shares: each document's chunks reported exactly once, whatever
happened to it meanwhile (edited, gone bad, recorded again after a race)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class PlannedShare:
    """A document's chunks as progress, held to the count planned: a file edited between
    planning and encoding (a progress bar ran past its total) or gone bad since (one stopped
    short of it) still reports exactly what was planned."""

    planned: int
    report: Callable[[int], None] | None
    drop: Callable[[int], None] | None = None  # told the rest at the end, if given
    reported: int = 0

    def __call__(self, chunks: int) -> None:
        chunks = min(chunks, self.planned - self.reported)
        if chunks > 0 and self.report is not None:
            self.report(chunks)
        self.reported += max(chunks, 0)

    def finish(self) -> None:
        """The document is done (ingested or skipped): the rest of its planned share, to
        `drop` when given (those chunks never came), else as if done."""
        rest = self.planned - self.reported
        if rest <= 0 or self.drop is None:
            self(rest)
            return
        self.drop(rest)
        self.reported += rest
