"""Where a served phase's time goes, from the workers' step traces (pdserve.engine.core.step_trace):
``benchmarks/lora_serving.py --step-trace-dir DIR`` prints this table after its rounds.

For each phase (its wall-clock window, as the benchmark timed it) and each worker: how many
engine steps began in the window, their wall seconds summed (``step s``), the engine thread's
own CPU seconds in them (``cpu s``: well under ``step s`` means the step waited for the GIL or
a core), the share of the window the worker spent in steps (``busy``: step seconds over
the window), the prompt tokens it ran, and for a decode worker its mean decode batch (tokens a
decode step) and the number of steps with a decode batch of 1 to 4.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pdserve.engine.core.step_trace import TracedStep, read


@dataclass(frozen=True)
class Window:
    name: str  # "base 1", "mixed 1", ...
    start: float  # Unix seconds
    end: float


@dataclass(frozen=True)
class WorkerPhase:
    worker: str
    window: Window
    steps: int
    step_s: float
    cpu_s: float
    prompt_tokens: int
    decode_steps: int
    decode_rows: int  # decode tokens over every decode step
    small_decode_steps: int  # decode batches of 1 to 4

    @property
    def busy(self) -> float:
        return self.step_s / max(self.window.end - self.window.start, 1e-9)

    @property
    def mean_batch(self) -> float:
        return self.decode_rows / self.decode_steps if self.decode_steps else 0.0


def summarise(steps: list[TracedStep], worker: str, window: Window) -> WorkerPhase:
    inside = [s for s in steps if window.start <= s.start < window.end]
    decode = [s for s in inside if s.shape.decode_batch]
    return WorkerPhase(worker, window, len(inside), sum(s.seconds for s in inside),
                       sum(s.cpu_seconds or 0.0 for s in inside),
                       sum(n for s in inside for n, _ in s.shape.prefill), len(decode),
                       sum(s.shape.decode_batch for s in decode), sum(1 for s in decode if s.shape.decode_batch <= 4))


def report(trace_dir: str | Path, windows: list[Window]) -> list[WorkerPhase]:
    """Every worker's share of every window, printed as a table; the rows printed."""
    rows = []
    for path in sorted(Path(trace_dir).glob("*.steps.jsonl")):
        worker = path.name.removesuffix(".steps.jsonl")
        steps = list(read(path))
        rows += [summarise(steps, worker, w) for w in windows]
    print(f"{'phase':<9} {'worker':<10} {'wall s':>7} {'steps':>6} {'step s':>7} {'cpu s':>7} {'busy':>5} "
          f"{'prompt tok':>10} {'mean batch':>10} {'batch<=4':>8}")
    for r in sorted(rows, key=lambda r: (r.window.start, r.worker)):
        print(f"{r.window.name:<9} {r.worker:<10} {r.window.end - r.window.start:7.2f} {r.steps:6d} {r.step_s:7.2f} "
              f"{r.cpu_s:7.2f} {r.busy:5.2f} {r.prompt_tokens:10d} {r.mean_batch:10.1f} {r.small_decode_steps:8d}")
    return rows
