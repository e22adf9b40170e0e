"""Borrowed cores (pdserve/engine/kernels/csrc/borrow_pool.h): a worker's kernels also run on idle-priority
helpers on another worker's cores. Whichever thread computes a chunk, the bits are the same.

The pool is once per process, so the check runs in a fresh process: the decoder's linears and
paged attention before the pool starts, then with it, compared bitwise.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.engine.kernels import cpu_kernels

pytestmark = pytest.mark.skipif(not cpu_kernels.cpu_supported() or (os.cpu_count() or 1) < 2,
                                reason="needs an x86-64 CPU with AVX2 + FMA and two cores")

CHILD = r"""
import os, torch
from pdserve.engine.kernels import cpu_kernels
from pdserve.engine.linear import PackedLinear
cpu_kernels.load()
os.sched_setaffinity(0, {0})
torch.set_num_threads(1)
g = torch.Generator().manual_seed(0)
layers = [PackedLinear((torch.randn(n, k, generator=g) * k ** -0.5).bfloat16(), None) for n, k in
          [(960, 576), (3072, 576), (576, 1536), (49152, 576)]]
xs = {k: torch.randn(70, k, generator=g).bfloat16() for k in (576, 1536)}
q = torch.randn(40, 9, 64, generator=g).bfloat16()
kv = torch.randn(2, 32, 16, 3, 64, generator=g).bfloat16()
tables = torch.arange(32, dtype=torch.int32).view(4, 8)
cu = torch.tensor([0, 1, 2, 39, 40], dtype=torch.int32)
ctx = torch.tensor([100, 17, 120, 64], dtype=torch.int32)

rows = torch.randn(70, 576, generator=g).bfloat16()
norm_w = torch.randn(576, generator=g).bfloat16()
gate_up = torch.randn(70, 3072, generator=g).bfloat16()
qkv = torch.randn(70, 15 * 64, generator=g).bfloat16()
cos, sin = (torch.randn(70, 1, 64, generator=g).bfloat16() for _ in range(2))
slots = torch.randperm(32 * 16, generator=g)[:70]

def rope(m):  # the rotated queries, and the keys and values it stored
    kc, vc = torch.zeros(32, 16, 3, 64).bfloat16(), torch.zeros(32, 16, 3, 64).bfloat16()
    out = torch.ops.pdserve.rope_store_kv(qkv[:m], cos[:m], sin[:m], kc, vc, slots[:m] // 16, slots[:m] % 16, 9, 3)
    return [out, kc, vc]

def run():
    outs = [l(xs[l.in_features][:m]) for l in layers for m in (1, 16, 70)]
    for m in (1, 16, 70):  # the row-wise kernels of a prefill take chunks of rows too
        outs += [torch.ops.pdserve.rms_norm(rows[:m], norm_w, 1e-5), torch.ops.pdserve.silu_mul(gate_up[:m]),
                 *torch.ops.pdserve.add_rms_norm(rows[:m], rows.flip(0)[:m], norm_w, 1e-5), *rope(m)]
    return outs + [torch.ops.pdserve.paged_attention(q, kv[0], kv[1], tables, cu, ctx, 0.125)]

before = run()
print("helpers", torch.ops.pdserve.start_borrow_pool([0], [1]))
ran = 0
for _ in range(20):
    after = run()
    assert all(torch.equal(a, b) for a, b in zip(before, after)), "a chunk run by a helper changed the bits"
    ran += torch.ops.pdserve.borrow_pool_helpers()
print("jobs a helper joined (of the last in each round):", ran)
"""


def test_outputs_are_bitwise_the_same_with_borrowed_cores():
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", CHILD], cwd=root, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "helpers 1" in out.stdout


STRESS = r"""
import os, torch
from pdserve.engine.kernels import cpu_kernels
from pdserve.engine.linear import PackedLinear
cpu_kernels.load()
os.sched_setaffinity(0, {0})
torch.set_num_threads(1)
g = torch.Generator().manual_seed(0)
small = [PackedLinear((torch.randn(n, 64, generator=g) * 0.1).bfloat16(), None) for n in (48, 160, 96, 320)]
xs = [torch.randn(m, 64, generator=g).bfloat16() for m in (1, 3, 17, 40)]
want = [[l(x) for x in xs] for l in small]
torch.ops.pdserve.start_borrow_pool([0], [1])
# The lender: a normal-priority process on the helper's core, busy and idle in short turns, so
# the helper is preempted at every point of its loop (as a prefill worker's steps preempt it).
lender = os.fork()
if lender == 0:
    os.sched_setaffinity(0, {1})
    import time
    while True:
        end = time.perf_counter() + 0.0003
        while time.perf_counter() < end:
            pass
        time.sleep(0.0002)
try:
    for _ in range(1500):  # many short jobs back to back: each one's fields follow the last one's at once
        for l, w in zip(small, want):
            for x, y in zip(xs, w):
                assert torch.equal(l(x), y)
finally:
    os.kill(lender, 9)
print("ok")
"""


def test_many_short_jobs_back_to_back_keep_their_bits_and_the_process_alive():
    """A helper must act only on the job it read: jobs of different sizes, back to back, as a
    decode step's linears come (a helper that mixed one job's size with another's ran chunks
    after their buffers were freed, and a worker died of it under the fuzz tests)."""
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", STRESS], cwd=root, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and "ok" in out.stdout, (out.returncode, out.stderr[-2000:])


STALL = r"""
import os, time, torch
from pdserve.engine.kernels import cpu_kernels
from pdserve.engine.linear import PackedLinear
cpu_kernels.load()
os.sched_setaffinity(0, {0})
torch.set_num_threads(1)
ops = torch.ops.pdserve
g = torch.Generator().manual_seed(0)
big = PackedLinear((torch.randn(8192, 576, generator=g) * 576 ** -0.5).bfloat16(), None)
x = torch.randn(24, 576, generator=g).bfloat16()
q = torch.randn(40, 9, 64, generator=g).bfloat16()
kv = torch.randn(2, 32, 16, 3, 64, generator=g).bfloat16()
tables = torch.arange(32, dtype=torch.int32).view(4, 8)
cu = torch.tensor([0, 1, 2, 39, 40], dtype=torch.int32)
ctx = torch.tensor([100, 17, 120, 64], dtype=torch.int32)

def run():  # fresh inputs each call: once a call returns, only the pool's job holds them
    return (big(x.clone()), ops.paged_attention(q.clone(), kv[0], kv[1], tables.clone(), cu.clone(), ctx.clone(), 0.125))

want = run()
ops.start_borrow_pool([0], [1])
STALL_S = 2.0
ops.borrow_pool_stall_next(1, int(STALL_S * 1e6))
slowest, deadline = 0.0, time.monotonic() + 120
while ops.borrow_pool_stats()[4] == 0:  # until the helper has claimed a chunk (and stalled on it)
    assert time.monotonic() < deadline, "the helper never claimed a chunk in 120 s"
    t0 = time.perf_counter()
    got = run()
    slowest = max(slowest, time.perf_counter() - t0)
    assert all(torch.equal(a, b) for a, b in zip(got, want)), "a chunk changed bits"
for _ in range(20):  # the stalled chunk's job, and more, while the helper sleeps
    t0 = time.perf_counter()
    got = run()
    slowest = max(slowest, time.perf_counter() - t0)
    assert all(torch.equal(a, b) for a, b in zip(got, want)), "a chunk changed bits"
stats = ops.borrow_pool_stats()
print("stats after the stall", stats, "slowest call", round(slowest, 3))
assert stats[2] >= 1, "the owner never stole the stalled chunk"
assert slowest < STALL_S / 4, f"a call took {slowest:.3f} s: the owner waited for the stalled helper"
dropped = stats[3]
deadline = time.monotonic() + STALL_S + 60
while ops.borrow_pool_stats()[3] == dropped:  # the helper wakes, computes, and loses its CAS
    assert time.monotonic() < deadline, "the stalled helper's late chunk was never dropped"
    got = run()
    assert all(torch.equal(a, b) for a, b in zip(got, want)), "a late helper's chunk reached an output"
    time.sleep(0.05)
print("ok", ops.borrow_pool_stats())
"""


def test_a_stalled_helper_is_stolen_from_and_never_waited_for():
    """A helper that claims a chunk and then stalls (the test hook sleeps it 2 s, as a decode
    step preempting it would): the owner takes the chunk back and computes it itself, so no call
    waits for it, the bits stay those of the unborrowed path, and the helper's late result,
    computed after its call returned, is dropped instead of written anywhere."""
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", STALL], cwd=root, capture_output=True, text=True, timeout=400)
    assert out.returncode == 0 and "ok" in out.stdout, (out.returncode, out.stdout[-2000:], out.stderr[-2000:])
