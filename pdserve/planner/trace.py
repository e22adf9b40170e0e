"""The request trace: one JSON object per line, oldest first.

    {"t": 12.031, "prompt_tokens": 812, "output_tokens": 164, "prefix_hash": "9f2c...", "prefix_tokens": 64}

``t`` is seconds since the trace started; ``prefix_hash`` (optional) names a shared prompt
prefix of ``prefix_tokens`` tokens: requests with the same hash share those leading tokens,
so a prefix cache can serve them. The router writes this format (``pdserve.router.request_trace``,
which also holds the record type), synthetic workloads (``pdserve.planner.synthetic``) produce it, and the simulator replays it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Iterator

from pdserve.router.request_trace import TraceError, TraceRequest

__all__ = ["TraceError", "TraceRequest", "iter_json", "read_trace", "write_trace"]


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
