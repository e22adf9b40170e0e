"""KV-transfer throughput between two processes: NIXL READ vs tcp vs a plain memory copy.

A holder process owns a block-first cache; this process reads scattered blocks (random ids
on both sides, as paged KV is) into its own cache and times start_read -> DONE. In the same
run it times torch ``copy_`` of the same number of contiguous bytes and ``index_copy_`` of
the same number of blocks into scattered positions, so the NIXL/memcpy ratio compares like
with like. ``index_copy_`` runs on the cache viewed as int64: on uint8 rows torch takes a
byte-wise kernel (~1 GB/s here) that says nothing about memory bandwidth. Transfers of a few
MB fit in the last-level cache, so ``copy_`` there measures cache, not DRAM, bandwidth.
All buffers sit on transparent huge pages, as a worker's KV cache does (``host_zeros``); the
"nixl 4 KiB pages" column repeats the NIXL run on ordinary pages.

    .venv/bin/python benchmarks/kv_transfer.py            # table + benchmarks_kv_transfer.png

Default block: SmolLM2-135M in bf16, 30 layers x (K,V) x 16 tokens x 3 kv heads x 64 dims x
2 bytes = 368,640 bytes. GB/s is 1e9 bytes per second, median over repetitions.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from pdserve.engine.kv_cache import host_zeros  # noqa: E402
from pdserve.kv_transfer import TransferState, create_agent  # noqa: E402
from pdserve.protos import kv_transfer_pb2  # noqa: E402

SMOLLM2_BLOCK_BYTES = 30 * 2 * 16 * 3 * 64 * 2  # layers, K/V, tokens, kv heads, dims, bf16


def _fill_pattern(cache: torch.Tensor) -> None:
    """Block i holds the byte i % 251 everywhere: cheap to write, easy to verify."""
    values = torch.arange(cache.shape[0], dtype=torch.int64) % 251
    cache.copy_(values.to(torch.uint8)[:, None].expand_as(cache))


def _cache(shape: tuple[int, int], dtype: torch.dtype, huge_pages: bool) -> torch.Tensor:
    """Memory as a worker's KV cache has it (``host_zeros``: huge pages), or plain 4 KiB pages."""
    return host_zeros(shape, dtype) if huge_pages else torch.zeros(shape, dtype=dtype)


def _holder_main(conn, backend: str, num_blocks: int, block_bytes: int, opts: dict,
                 huge_pages: bool) -> None:
    cache = _cache((num_blocks, block_bytes), torch.uint8, huge_pages)
    _fill_pattern(cache)
    agent = create_agent(backend, f"bench-holder-{backend}", cache, **opts)
    conn.send(agent.local_metadata().SerializeToString())
    conn.recv()  # "stop"
    agent.close()


def _timed_read(agent, peer: str, remote: list[int], local: list[int]) -> float:
    start = time.perf_counter()
    handle = agent.start_read(peer, remote, local, b"")
    # wait(), as the workers use it: a bare poll() spin would hold the GIL that the tcp
    # reader thread needs, and its sleeps add at most ~0.2 ms per read.
    state = agent.wait(handle, timeout_s=60)
    if state != TransferState.DONE:
        raise RuntimeError(f"benchmark read failed: {state.name}: {handle.error}")
    return time.perf_counter() - start


def _median_gbps(nbytes: int, seconds: list[float]) -> float:
    return nbytes / statistics.median(seconds) / 1e9


def bench_backend(backend: str, sizes: list[int], reps: int, block_bytes: int,
                  gen: torch.Generator, bar: tqdm, huge_pages: bool = True,
                  **opts) -> dict[int, float]:
    """GB/s of scattered reads of each size from a holder process over ``backend``.

    Both caches sit on huge pages as the workers' do, unless ``huge_pages`` is False.
    ``opts`` go to both agents (``create_agent``), e.g. NIXL's ``num_threads``.
    """
    num_blocks = 2 * max(sizes)  # room to scatter
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    holder = ctx.Process(target=_holder_main,
                         args=(child, backend, num_blocks, block_bytes, opts, huge_pages))
    holder.start()
    reader = create_agent(backend, f"bench-reader-{backend}",
                          _cache((num_blocks, block_bytes), torch.uint8, huge_pages), **opts)
    results: dict[int, float] = {}
    try:
        peer = reader.add_remote(kv_transfer_pb2.AgentMetadata.FromString(conn.recv()))
        for n in sizes:
            remote = torch.randperm(num_blocks, generator=gen)[:n].tolist()
            local = torch.randperm(num_blocks, generator=gen)[:n].tolist()
            _timed_read(reader, peer, remote, local)  # warm-up: connect, fault pages in
            expected = (torch.tensor(remote) % 251).to(torch.uint8)[:, None]
            if not torch.equal(reader.cache[local], expected.expand(n, block_bytes)):
                raise RuntimeError(f"{backend}: read of {n} blocks delivered wrong bytes")
            seconds = [_timed_read(reader, peer, remote, local) for _ in range(reps)]
            results[n] = _median_gbps(n * block_bytes, seconds)
            bar.update()
    finally:
        reader.close()
        conn.send("stop")
        holder.join(30)
    return results


def bench_memcpy(sizes: list[int], reps: int, block_bytes: int, gen: torch.Generator,
                 bar: tqdm) -> tuple[dict[int, float], dict[int, float]]:
    """GB/s of contiguous ``copy_`` and of ``index_copy_`` into scattered blocks."""
    if block_bytes % 8:
        raise ValueError(f"--block-bytes must be a multiple of 8, got {block_bytes}")
    num_blocks = 2 * max(sizes)
    cache = host_zeros((num_blocks, block_bytes // 8), torch.int64)
    copy_rate, index_rate = {}, {}
    for n in sizes:
        src = host_zeros((n, block_bytes // 8), torch.int64).fill_(1)
        dst = host_zeros((n, block_bytes // 8), torch.int64)
        local = torch.randperm(num_blocks, generator=gen)[:n]
        nbytes = n * block_bytes
        copy_rate[n] = _median_gbps(nbytes, _time(lambda: dst.copy_(src), reps))
        index_rate[n] = _median_gbps(nbytes,
                                     _time(lambda: cache.index_copy_(0, local, src), reps))
        bar.update()
    return copy_rate, index_rate


def _time(fn, reps: int) -> list[float]:
    fn()  # warm-up: fault pages in
    out = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def print_table(sizes: list[int], block_bytes: int, rates: dict[str, dict[int, float]],
                load: str) -> None:
    """Markdown table, one row per transfer size."""
    cols = list(rates)
    print(f"\nblock_bytes = {block_bytes:,}; GB/s = 1e9 B/s, median; torch threads = "
          f"{torch.get_num_threads()}; load average at start = {load}")
    print("| blocks | MB | " + " | ".join(f"{c} GB/s" for c in cols) + " | nixl / copy_ |")
    print("|---:|---:|" + "---:|" * len(cols) + "---:|")
    for n in sizes:
        cells = " | ".join(f"{rates[c][n]:.2f}" if n in rates[c] else "-" for c in cols)
        ratio = (f"{rates['nixl'][n] / rates['copy_'][n]:.2f}"
                 if "nixl" in rates and "copy_" in rates else "-")
        print(f"| {n} | {n * block_bytes / 1e6:.1f} | {cells} | {ratio} |")


def _load() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "n/a"


def plot(sizes: list[int], rates: dict[str, dict[int, float]], block_bytes: int,
         path: Path) -> None:
    """GB/s against blocks per read, one line per method."""
    import matplotlib

    matplotlib.use("Agg")  # headless
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, by_size in rates.items():
        xs = [n for n in sizes if n in by_size]
        ax.plot(xs, [by_size[n] for n in xs], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(n) for n in sizes])
    ax.set_xlabel(f"blocks per read ({block_bytes:,} B each)")
    ax.set_ylabel("GB/s (median)")
    ax.set_title("KV block transfer between two processes vs memory copy (CPU)")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    """Run the benchmark; see ``--help``."""
    from benchmarks.processor import print_banner

    print_banner()  # the processor and kernel path every figure below ran on
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block-bytes", type=int, default=SMOLLM2_BLOCK_BYTES)
    parser.add_argument("--sizes", default="8,32,128,512", help="blocks per read")
    parser.add_argument("--reps", type=int, default=10, help="timed reads per size")
    parser.add_argument("--backends", default="nixl,tcp")
    parser.add_argument("--nixl-threads", default="2",
                        help="extra NIXL runs with these UCX num_threads (comma list; "
                             "the plain nixl column is NIXL's default, 0)")
    # One thread by default: NIXL's copy is single-threaded too, and on a small shared host
    # torch's 2-thread pool stalled every copy ~8 ms waiting for its second thread.
    parser.add_argument("--torch-threads", type=int, default=1,
                        help="torch intra-op threads for the memcpy baselines")
    parser.add_argument("--plot", type=Path, default=REPO_ROOT / "docs" / "benchmarks" / "benchmarks_kv_transfer.png")
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.torch_threads)
    sizes = [int(s) for s in args.sizes.split(",")]
    backends = [b for b in args.backends.split(",") if b]
    gen = torch.Generator().manual_seed(0)
    load = _load()  # the host may be shared: record how busy it was

    rates: dict[str, dict[int, float]] = {}
    runs = [(b, b, {}) for b in backends]
    if "nixl" in backends:
        runs += [(f"nixl {n} threads", "nixl", {"num_threads": int(n)})
                 for n in args.nixl_threads.split(",") if n]
        runs.append(("nixl 4 KiB pages", "nixl", {"huge_pages": False}))
    with tqdm(total=len(sizes) * (len(runs) + 1), desc="kv_transfer bench") as bar:
        for label, backend, opts in runs:
            bar.set_postfix_str(label)
            rates[label] = bench_backend(backend, sizes, args.reps, args.block_bytes, gen, bar,
                                         **opts)
        bar.set_postfix_str("memcpy")
        rates["copy_"], rates["index_copy_"] = bench_memcpy(sizes, args.reps,
                                                            args.block_bytes, gen, bar)
    print_table(sizes, args.block_bytes, rates, load)
    if not args.no_plot:
        plot(sizes, rates, args.block_bytes, args.plot)
        print(f"\nplot: {args.plot}")


if __name__ == "__main__":
    main()
