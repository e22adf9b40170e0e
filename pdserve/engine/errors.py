"""Typed errors raised by the engine. Each names what was wrong and the limit it broke."""

from __future__ import annotations


class EngineError(Exception):
    """Base class of every error the engine raises on purpose."""


class ModelLoadError(EngineError):
    """A model could not be loaded: ``path`` names the file or directory, ``reason`` says why."""

    def __init__(self, path: str, reason: str):
        self.path = str(path)
        self.reason = reason
        super().__init__(f"cannot load model from {self.path}: {reason}")


class InvalidRequestError(EngineError, ValueError):
    """A request field is out of range. ``field`` is its name, ``limit`` the bound it broke."""

    def __init__(self, field: str, message: str, limit: object = None):
        self.field = field
        self.limit = limit
        self.reason = message  # the message without the field
        super().__init__(f"{field}: {message}")


class CacheCapacityError(EngineError):
    """A request can never fit in this worker's KV cache, however long it waits."""

    def __init__(self, needed_blocks: int, total_blocks: int):
        self.needed_blocks = needed_blocks
        self.total_blocks = total_blocks
        super().__init__(
            f"request needs {needed_blocks} KV blocks but the cache holds only {total_blocks}"
        )


class StepFailed(EngineError):
    """A step raised and no part of it ran when its batch was split and run again
    (``pdserve.engine.core.step_isolation``): the fault is pinned on none of its sequences
    (``request_ids``), which were aborted and their blocks freed; the engine goes on with
    everything else. Not the requests' fault: another worker may serve them. ``cause`` is the
    original error."""

    def __init__(self, request_ids: list[str], cause: BaseException):
        self.request_ids = list(request_ids)
        self.cause = cause
        super().__init__(f"engine step failed ({type(cause).__name__}: {cause}); "
                         f"aborted {len(self.request_ids)} request(s) of that step")


class SequenceFailed(InvalidRequestError):
    """One sequence's own fault, found while it was in the engine (its grammar rejects its
    tokens or does not compile, its logits are NaN, its step raised with it alone in it): that
    sequence alone ended, with finish reason "error"; the rest of its step went on as if it had
    never been there. ``field`` names what failed, ``limit`` the bound it broke, if any."""

    def __init__(self, request_id: str, field: str, message: str, limit: object = None):
        self.request_id = request_id
        super().__init__(field, f"request failed in the engine: {message}", limit)

    @classmethod
    def of(cls, request_id: str, error: InvalidRequestError) -> "SequenceFailed":
        """``error``, found for ``request_id`` after it entered the engine."""
        return cls(request_id, error.field, error.reason, error.limit)


class RankLost(EngineError):
    """A rank of a tensor-parallel worker died, or a collective between the ranks failed: the
    ranks are out of step, and no step can run again. The worker is dead as a whole (its
    process exits, ``pdserve.engine.distributed.group``), and what it ran moves as from any dead worker."""


class KVMemoryError(EngineError, ValueError):
    """The device cannot give the KV cache what its setting asks: ``setting`` names it (e.g.
    ``gpu_memory_utilization``), the message carries the numbers."""

    def __init__(self, setting: str, message: str):
        self.setting = setting
        super().__init__(f"{setting}: {message}")
