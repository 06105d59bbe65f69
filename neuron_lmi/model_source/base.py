"""Shared pieces of the model sources: their errors and the loading deadline."""

from __future__ import annotations

import time
from dataclasses import dataclass


class ModelSourceError(RuntimeError):
    """A model could not be located or fetched; the message names the model id and what to try."""


class ModelLoadTimeout(TimeoutError):
    """Fetching the model took longer than ``model_loading_timeout``; partial files are kept."""


@dataclass(frozen=True, slots=True)
class Deadline:
    """``model_loading_timeout`` as an absolute monotonic time; ``at`` None means no limit."""

    model_id: str
    limit_s: float | None
    at: float | None

    @classmethod
    def start(cls, model_id: str, limit_s: float | None) -> Deadline:
        return cls(model_id, limit_s, None if limit_s is None else time.monotonic() + limit_s)

    def remaining(self) -> float | None:
        return None if self.at is None else self.at - time.monotonic()

    def check(self) -> None:
        left = self.remaining()
        if left is not None and left <= 0:
            raise ModelLoadTimeout(
                f"model {self.model_id!r} was not fetched within model_loading_timeout={self.limit_s:g}s; "
                "partial downloads are kept and resume on the next start"
            )
