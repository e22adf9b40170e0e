"""``pdserve profile``'s GEMM table: how near the core's peak the prefill GEMMs run, per kernel path.

A prefill step's time is mostly its projections (issue 59: on an Intel Xeon a prompt's first
token came 1.4x later than vLLM's). For each kernel path this processor runs (pdserve's linear
kernel, ``torch.ops.pdserve.linear`` on weights packed for that path) and for torch's own matmul
(``torch.nn.functional.linear``: oneDNN on CPU) in the same run, each of the model's four
projections (qkv, o, gate_up, down) is timed at 256, 1,024 and 2,048 prompt tokens in bfloat16
and float32, on one thread (a worker's), the fastest of a few runs on that thread's CPU time
(``peak.timed``: a shared machine's other processes do not count). Rates are 2 x M x N x K
over the time; the core's peak is ``peak.Core.peak_flops`` for the path and dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.planner.model_spec import ModelSpec
from pdserve.planner.peak import Core, timed

TOKENS = (256, 1024, 2048)
DTYPES = ("bfloat16", "float32")
TORCH = "torch"  # the row of torch's own matmul


@dataclass(frozen=True)
class Gemm:
    name: str
    n: int  # output features
    k: int  # input features

    def flops(self, m: int) -> float:
        return 2.0 * m * self.n * self.k


def prefill_gemms(spec: ModelSpec) -> tuple[Gemm, ...]:
    """The projections one decoder layer runs on a prompt's tokens (a dense model's)."""
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    up = spec.intermediate_size * (2 if spec.mlp_matrices == 3 else 1)
    return (Gemm("qkv", q + 2 * kv, spec.hidden_size), Gemm("o", spec.hidden_size, q),
            Gemm("gate_up", up, spec.hidden_size), Gemm("down", spec.hidden_size, spec.intermediate_size))


@dataclass(frozen=True)
class Cell:
    path: str  # a kernel path, or ``TORCH``
    dtype: str
    tokens: int
    gemm: Gemm
    seconds: float

    @property
    def flops_per_s(self) -> float:
        return self.gemm.flops(self.tokens) / self.seconds


def measure(gemms: tuple[Gemm, ...], paths: list[str], tokens=TOKENS, dtypes=DTYPES, repeats: int = 5,
            progress: bool = True) -> list[Cell]:
    """Every GEMM at every token count and dtype on each path, and torch's; one thread.
    Leaves the process's kernel path as it found it."""
    import torch
    from tqdm import tqdm

    from pdserve.engine.kernels import cpu_kernels

    cpu_kernels.load()
    before, threads = cpu_kernels.isa(), torch.get_num_threads()
    torch.set_num_threads(1)
    bar = tqdm(total=len(dtypes) * (len(paths) + 1) * len(gemms) * len(tokens), desc="prefill GEMMs",
               unit="GEMM", disable=not progress)
    cells = []
    try:
        for dtype in dtypes:
            dt = getattr(torch, dtype)
            gen = torch.Generator().manual_seed(0)
            weights = {g: torch.randn(g.n, g.k, generator=gen).mul_(0.05).to(dt) for g in gemms}
            inputs = {(g.k, m): torch.randn(m, g.k, generator=gen).to(dt) for g in gemms for m in tokens}
            for path in [TORCH, *paths]:
                ops = _ops(path, weights)
                for g in gemms:
                    for m in tokens:
                        x = inputs[(g.k, m)]
                        cells.append(Cell(path, dtype, m, g, timed(lambda: ops[g](x), repeats)))
                        bar.update(1)
    finally:
        cpu_kernels.set_isa(before)
        torch.set_num_threads(threads)
        bar.close()
    return cells


def _ops(path: str, weights: dict) -> dict:
    """Each GEMM as a callable of x on ``path`` (weights packed for it), or torch's matmul."""
    import torch
    import torch.nn.functional as F

    if path == TORCH:
        return {g: (lambda x, w=w: F.linear(x, w)) for g, w in weights.items()}
    from pdserve.engine.kernels import cpu_kernels

    cpu_kernels.set_isa(path)
    ops = {}
    for g, w in weights.items():
        packed = torch.ops.pdserve.linear_pack(w)  # after set_isa: the layout is the path's
        ops[g] = lambda x, p=packed, n=g.n: torch.ops.pdserve.linear(x, p, n, None, False)
    return ops


def table(cells: list[Cell], core: Core) -> list[str]:
    """A markdown table, a row per path, dtype and token count: each GEMM's GFLOP/s and share of
    the path's peak, the four together (their FLOPs over their summed time), and torch's four
    together for the same dtype and tokens, as a share of the highest peak of any path here for
    that dtype (oneDNN picks its own instructions: bfloat16 dot products wherever the processor
    has them, whichever path pdserve's kernels are pinned to)."""
    gemms = list(dict.fromkeys(c.gemm for c in cells))
    by = {(c.path, c.dtype, c.tokens, c.gemm): c for c in cells}
    head = (["| path | dtype | tokens | peak GFLOP/s |"] + [f" {g.name} |" for g in gemms]
            + [" together | torch (oneDNN) together | ours / torch |"])
    lines = ["".join(head), "|" + "---|" * (4 + len(gemms) + 3)]
    paths = list(dict.fromkeys(c.path for c in cells if c.path != TORCH))
    for path in paths:
        for dtype in dict.fromkeys(c.dtype for c in cells):
            peak = core.peak_flops(path, dtype)
            best = max(core.peak_flops(p, dtype) for p in paths)  # torch picks its own instructions
            for m in sorted({c.tokens for c in cells}):
                ours = [by[(path, dtype, m, g)] for g in gemms]
                theirs = [by[(TORCH, dtype, m, g)] for g in gemms]
                row = [f"| {path} | {dtype} | {m} | {peak / 1e9:.0f} |"]
                row += [f" {c.flops_per_s / 1e9:.1f} ({c.flops_per_s / peak:.0%}) |" for c in ours]
                all_ours, all_torch = _together(ours), _together(theirs)
                row += [f" **{all_ours / 1e9:.1f} ({all_ours / peak:.0%})** | {all_torch / 1e9:.1f} "
                        f"({all_torch / best:.0%}) | {all_ours / all_torch:.2f}x |"]
                lines.append("".join(row))
    return lines


def _together(cells: list[Cell]) -> float:
    return sum(c.gemm.flops(c.tokens) for c in cells) / sum(c.seconds for c in cells)


def notes(core: Core, paths: list[str]) -> list[str]:
    """What the peaks are made of, for under the table."""
    out = [f"clock {core.clock.hz / 1e9:.2f} GHz ({core.clock.how}); peak = FMA/cycle x lanes x products x 2 x clock "
           "(torch's share: of the highest peak here for its dtype):"]
    for path in paths:
        out.append(f"  {path}: bfloat16 {core.describe(path, 'bfloat16')}; float32 {core.describe(path, 'float32')}")
    return out
