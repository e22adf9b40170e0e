"""Recording the router's traffic as a replayable trace: the record type (``TraceRequest``)
and the writer. The planner reads and replays these traces (``pdserve.planner.trace``,
``pdserve.planner.simulator``); the types live here so that the router does not import the planner.

The router calls ``record`` once per request when it ends, with the prompt's token ids, the
tokens it sent and its arrival time. The trace keeps no text and no token ids, only lengths
and a prefix hash: the engine's chained block hash (``pdserve.engine.core.block_manager.chain_hash``) of
the prompt's first ``prefix_blocks`` full blocks, so requests that share a system prompt get
the same hash and a replay sees their prefix-cache hits. Turned on by the environment
variable ``PDSERVE_TRACE_FILE`` (read once, where the router builds its service), so a
running cluster can be recorded without a new flag on every layer.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from pdserve.engine.core.block_manager import NO_HASH, chain_hash

ENV = "PDSERVE_TRACE_FILE"


class TraceError(ValueError):
    """A trace line is malformed; ``field`` names the value and the message the line."""

    def __init__(self, field: str, problem: str):
        self.field = field
        super().__init__(f"{field}: {problem}")


@dataclass(frozen=True)
class TraceRequest:
    t: float  # arrival, seconds since the start of the trace
    prompt_tokens: int
    output_tokens: int  # tokens generated (the first one included)
    prefix_hash: str | None = None
    prefix_tokens: int = 0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.t) and self.t >= 0):
            raise TraceError("t", f"must be a finite number >= 0, got {self.t}")
        if self.prompt_tokens < 1:
            raise TraceError("prompt_tokens", f"must be >= 1, got {self.prompt_tokens}")
        if self.output_tokens < 1:
            raise TraceError("output_tokens", f"must be >= 1, got {self.output_tokens}")
        if not 0 <= self.prefix_tokens <= self.prompt_tokens:
            raise TraceError("prefix_tokens", f"must be within [0, prompt_tokens={self.prompt_tokens}], "
                                              f"got {self.prefix_tokens}")

    def to_json(self) -> str:
        values = {"t": round(self.t, 6), "prompt_tokens": self.prompt_tokens, "output_tokens": self.output_tokens}
        if self.prefix_hash is not None:
            values.update(prefix_hash=self.prefix_hash, prefix_tokens=self.prefix_tokens)
        return json.dumps(values)


class TraceWriter:
    def __init__(self, path: str | Path, block_size: int = 16, prefix_blocks: int = 4,
                 clock: Callable[[], float] = time.monotonic):
        self.path = Path(path)
        self.block_size, self.prefix_blocks, self.clock = block_size, prefix_blocks, clock
        self._t0: float | None = None
        self._lock = threading.Lock()
        self._file = open(self.path, "a", buffering=1)  # line-buffered: a crash loses at most a line

    @classmethod
    def from_env(cls) -> TraceWriter | None:
        path = os.environ.get(ENV)
        return cls(path) if path else None

    def prefix_of(self, prompt: Sequence[int]) -> tuple[str | None, int]:
        """(hash, tokens) of the prompt's leading full blocks, at most ``prefix_blocks`` of them."""
        blocks = min(len(prompt) // self.block_size, self.prefix_blocks)
        if blocks == 0:
            return None, 0
        h = NO_HASH
        for i in range(blocks):
            h = chain_hash(h, prompt[i * self.block_size:(i + 1) * self.block_size])
        return h.hex(), blocks * self.block_size

    def record(self, prompt: Sequence[int], output_tokens: int, arrived: float | None = None) -> None:
        """One finished request (``output_tokens`` >= 1; a request that sent nothing is skipped)."""
        if output_tokens < 1 or not prompt:
            return
        t = self.clock() if arrived is None else arrived
        prefix_hash, prefix_tokens = self.prefix_of(prompt)
        with self._lock:
            if self._t0 is None:
                self._t0 = t
            line = TraceRequest(max(t - self._t0, 0.0), len(prompt), output_tokens, prefix_hash, prefix_tokens)
            self._file.write(line.to_json() + "\n")

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
