"""A per-step trace of a serving engine: one JSON line per engine step, for profiling a served
run after the fact (``pdserve serve --step-trace-dir``).

Each line is one step as the engine thread ran it::

    {"t": 1732400000.123, "s": 0.0161, "cpu": 0.0158, "idle": false, "prefill": [[256, 0]], "decode": [8, 2304], "sampled": 9}

- ``t``: when the step began (Unix seconds, ``time.time``), so steps line up with a client's clock;
- ``s``: how long ``LLMEngine.step`` took (schedule, forward, sample, postprocess), what
  ``pdserve profile`` times for each of its points;
- ``cpu``: the engine thread's own CPU seconds in that step (``time.thread_time``; torch's
  other intra-op threads not counted). Well under ``s`` on one thread means the step waited:
  for the GIL (other Python threads of the process: gRPC, another worker's engine) or for a
  core (other processes). Lines written before it existed have none (``None`` when read);
- ``idle``: the loop blocked with nothing to run since the previous step. Without it, the
  time between the end of the previous step and ``t`` is the loop's own overhead (queued
  calls, hooks, handing outputs to the streams);
- ``prefill``: one ``[new tokens, tokens cached before them]`` per sequence running prompt
  tokens this step (a chunk);
- ``decode``: ``[sequences, tokens of KV they hold]`` over the sequences decoding one token;
- ``sampled``: rows that produced a token.

That is what the planner's cost model takes (``CostModel.prefill_s(chunks, sampled)`` and
``decode_s(batch, total_context)``), so a trace can be set beside a profile step for step.
Writing costs one short line per step (line-buffered); nothing is recorded without a trace.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from pdserve.engine.core.scheduler import SchedulerOutput


@dataclass(frozen=True)
class StepShape:
    """What one step ran, before it ran (``num_computed_tokens`` moves during the step)."""

    prefill: tuple[tuple[int, int], ...]  # (new tokens, tokens cached before them) per prompt chunk
    decode_batch: int
    decode_context: int  # KV tokens held by the decode rows, together
    sampled: int

    @classmethod
    def of(cls, out: SchedulerOutput) -> "StepShape":
        prefill, batch, context, sampled = [], 0, 0, 0
        for item in out.seqs:
            seq = item.seq
            if seq.num_computed_tokens < seq.num_prompt_tokens:  # prompt tokens, however few
                prefill.append((item.num_new_tokens, seq.num_computed_tokens))
            else:
                batch += 1
                context += seq.num_computed_tokens
            sampled += item.sample
        return cls(tuple(prefill), batch, context, sampled)


@dataclass(frozen=True)
class TracedStep:
    start: float  # Unix seconds
    seconds: float
    after_idle: bool
    shape: StepShape
    cpu_seconds: float | None = None  # the engine thread's CPU time in the step; None: not recorded

    @property
    def end(self) -> float:
        return self.start + self.seconds


class StepTrace:
    """Appends steps to ``path`` (its directory is made); safe to close from another thread."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", buffering=1, encoding="utf-8")  # a line reaches the file whole
        self._lock = threading.Lock()
        if self._file.tell() and _last_byte(self.path) != b"\n":
            self._file.write("\n")  # an earlier run died mid-line: end it, or this run's first step joins it

    def write(self, start: float, seconds: float, after_idle: bool, shape: StepShape,
              cpu_seconds: float | None = None) -> None:
        row = {"t": round(start, 6), "s": round(seconds, 7)}
        if cpu_seconds is not None:
            row["cpu"] = round(cpu_seconds, 7)
        line = json.dumps({**row, "idle": after_idle,
                           "prefill": [list(c) for c in shape.prefill],
                           "decode": [shape.decode_batch, shape.decode_context], "sampled": shape.sampled},
                          separators=(",", ":"))
        with self._lock:
            if not self._file.closed:
                self._file.write(line + "\n")

    def close(self) -> None:
        with self._lock:
            self._file.close()


def _last_byte(path: Path) -> bytes:
    with open(path, "rb") as f:
        f.seek(-1, 2)
        return f.read(1)


def read(path: str | Path) -> Iterator[TracedStep]:
    """The steps of a trace file, in the order they ran. A last line cut short (the worker
    died mid-write) is skipped."""
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            yield TracedStep(row["t"], row["s"], row["idle"],
                             StepShape(tuple((int(n), int(c)) for n, c in row["prefill"]), int(row["decode"][0]),
                                       int(row["decode"][1]), int(row["sampled"])), row.get("cpu"))


def trace_path(directory: str | Path, worker_id: str) -> Path:
    """Where worker ``worker_id`` writes its steps under ``directory``."""
    return Path(directory) / f"{worker_id}.steps.jsonl"
