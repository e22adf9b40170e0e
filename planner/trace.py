"""The request trace: one JSON object per line, oldest first.

    {"t": 12.031, "prompt_tokens": 812, "output_tokens": 164, "prefix_hash": "9f2c...", "prefix_tokens": 64}

``t`` is seconds since the trace started; ``prefix_hash`` (optional) names a shared prompt
prefix of ``prefix_tokens`` tokens: requests with the same hash share those leading tokens,
so a prefix cache can serve them. The router writes this format (``planner.trace_writer``),
synthetic workloads (``planner.synthetic``) produce it, and the simulator replays it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator


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


def read_trace(path: str | Path) -> list[TraceRequest]:
    """Every request of a JSONL trace, sorted by arrival. Errors name the line."""
    out = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                out.append(_parse(line, f"{path}:{lineno}"))
    out.sort(key=lambda r: r.t)
    return out


def _parse(line: str, where: str) -> TraceRequest:
    try:
        v = json.loads(line)
        return TraceRequest(float(v["t"]), int(v["prompt_tokens"]), int(v["output_tokens"]),
                            v.get("prefix_hash"), int(v.get("prefix_tokens", 0)))
    except KeyError as exc:
        raise TraceError(str(exc.args[0]), f"missing at {where}") from exc
    except TraceError as exc:
        raise TraceError(exc.field, f"{exc} at {where}") from exc
    except (ValueError, TypeError) as exc:
        raise TraceError("line", f"not a trace record at {where}: {exc}") from exc


def write_trace(path: str | Path, requests: Iterable[TraceRequest]) -> None:
    with open(path, "w") as f:
        for r in requests:
            f.write(r.to_json() + "\n")


def iter_json(requests: Iterable[TraceRequest]) -> Iterator[str]:
    for r in requests:
        yield r.to_json()
