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
    .venv/bin/python benchmarks/kv_transfer.py --verify   # what checking every block costs (below)
    .venv/bin/python benchmarks/kv_transfer.py --by-head  # between tensor-parallel sizes (kv_by_head.py)

Default block: SmolLM2-135M in bf16, 30 layers x (K,V) x 16 tokens x 3 kv heads x 64 dims x
2 bytes = 368,640 bytes. GB/s is 1e9 bytes per second, median over repetitions.

``--verify`` measures the checksum every transfer carries (``pdserve/kv_transfer/checksum.py``):
first its cost, and that of the other hashes it was chosen against, on real KV blocks (the
default model's, prefilled here from a ``--verify-prompt-tokens`` prompt); then TTFT and TPOT
with verification on and off in one run: a cluster as ``make serve`` starts it (1 prefill + 1
decode worker, the default model, bfloat16, one core each), started four times in the order
on, off, off, on (``--verify-kv-transfers`` / ``--no-verify-kv-transfers``), each time alone on
the machine and sent the same greedy requests in bursts of ``--verify-concurrency`` for
``--verify-rounds`` rounds, so that a drift of the machine's speed falls on both alike. (Two
clusters side by side in one Ray, the first design, measured placement instead: the second
cluster's workers shared the first one's cores, and "on" came out 27% faster than "off".)
TTFT is from the call to the first token; TPOT is (last token time - first token time) /
(tokens - 1), both measured by the client.
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

from pdserve.engine.attention.kv_cache import host_zeros  # noqa: E402
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


def _hashes() -> dict:
    """The checksums measured, by name: the one pdserve uses first, then the others it was
    weighed against (crc32c only where a package brings it)."""
    import hashlib
    import zlib

    import xxhash

    out = {"xxh3_64 (pdserve)": xxhash.xxh3_64_intdigest, "xxh64": xxhash.xxh64_intdigest, "zlib crc32": zlib.crc32,
           "blake2b-64": lambda b: hashlib.blake2b(b, digest_size=8).digest()}
    try:
        import crc32c  # not a dependency: measured where installed
        out["crc32c"] = crc32c.crc32c
    except ImportError:
        pass
    return out


def real_blocks(prompt_tokens: int) -> torch.Tensor:
    """The KV blocks of a ``prompt_tokens`` prompt the default model (bfloat16) prefilled here,
    as (blocks, block_bytes) uint8 rows."""
    from pdserve.engine.config import CacheConfig, EngineConfig
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.sampling.params import SamplingParams
    from pdserve.kv_transfer.layout import block_bytes_view

    engine = LLMEngine.from_config(EngineConfig(dtype="bfloat16", cache=CacheConfig(num_blocks=prompt_tokens // 8 + 4)),
                                   progress=False, detokenize=False)
    prompt = torch.randint(100, 40000, (prompt_tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    engine.add_request("bench", prompt, SamplingParams(max_tokens=16, ignore_eos=True), hold_kv=True)  # HELD after one
    while not any(o.finished for o in engine.step()):
        pass
    ids = engine.held_block_ids("bench")[: prompt_tokens // engine.blocks.block_size]  # the full ones
    return block_bytes_view(engine.kv_cache)[ids].clone()


def bench_checksums(prompt_tokens: int, reps: int) -> None:
    """Per block and per prompt, each hash over the same real blocks (median of ``reps``)."""
    from pdserve.kv_transfer.checksum import block_checksums

    rows = real_blocks(prompt_tokens)
    n, block_bytes = rows.shape
    views = [memoryview(r) for r in rows.numpy()]
    print(f"\n{n} real KV blocks of the default model (bfloat16), {block_bytes:,} bytes each; median of {reps}")
    print(f"| checksum | us per block | GB/s | ms per {prompt_tokens}-token prompt |\n|---|---:|---:|---:|")
    timed = {name: (lambda h=h: [h(v) for v in views]) for name, h in _hashes().items()}
    timed["block_checksums (the code path)"] = lambda: block_checksums(rows, range(n))
    for name, fn in timed.items():
        per_prompt = statistics.median(_time(fn, reps))
        print(f"| {name} | {per_prompt / n * 1e6:.1f} | {n * block_bytes / per_prompt / 1e9:.1f} | "
              f"{per_prompt * 1e3:.2f} |")


def _timed_request(stub, text: str, tokens: int) -> tuple[float, float, float, float]:
    """(TTFT, TPOT, first gap, the later gaps' median) in seconds of one greedy request. The
    first gap (token 1 to token 2) holds the KV read and its verification; the later ones do not."""
    from pdserve.protos import pdserve_pb2

    req = pdserve_pb2.GenerateRequest(text=text, sampling=pdserve_pb2.SamplingParams(max_tokens=tokens, ignore_eos=True,
                                                                                    temperature=0.0))
    start, times = time.perf_counter(), []
    for r in stub.Generate(req, timeout=600):
        times += [time.perf_counter()] * len(r.token_ids)
    gaps = [b - a for a, b in zip(times, times[1:])]
    return times[0] - start, (times[-1] - times[0]) / (len(times) - 1), gaps[0], statistics.median(gaps[1:])


def bench_verify_serving(args) -> None:
    """TTFT and TPOT p50 with verification on and off, same run (see the module docstring)."""
    from concurrent.futures import ThreadPoolExecutor

    import grpc

    from pdserve.cluster.config import ClusterConfig
    from pdserve.cluster.local import LocalCluster
    from pdserve.engine.config import CacheConfig, EngineConfig
    from pdserve.protos import pdserve_pb2_grpc

    base = dict(engine=EngineConfig(cache=CacheConfig(memory_budget_bytes=256 << 20)), num_prefill=1, num_decode=1,
                grpc_port=0, http_port=None, threads_per_worker=1, supervise_interval_s=None)
    words = " ".join(f"w{i % 97}" for i in range(args.verify_prompt_tokens // 2))  # ~2 tokens a word
    results: dict[str, list[tuple[float, ...]]] = {"on": [], "off": []}
    phases = ("on", "off", "off", "on")
    by_phase: list[list[tuple[float, ...]]] = [[] for _ in phases]
    with tqdm(total=len(phases) * args.verify_rounds, desc="rounds (on, off, off, on)", unit="round") as bar:
        for phase, name in enumerate(phases):
            cluster = LocalCluster(ClusterConfig(**base, verify_kv_transfers=name == "on"))
            try:
                cluster.start()
                with grpc.insecure_channel(cluster.address) as channel, \
                        ThreadPoolExecutor(args.verify_concurrency) as pool:
                    stub = pdserve_pb2_grpc.GenerationStub(channel)
                    _timed_request(stub, "warm-up", 8)  # channels, NIXL metadata, the first read
                    for r in range(args.verify_rounds):
                        # The same prompts in both settings' phases, never one the cluster has seen.
                        texts = [f"Story {phase // 2 * 1000 + r}-{i}: {words}" for i in range(args.verify_concurrency)]
                        by_phase[phase] += pool.map(lambda t: _timed_request(stub, t, args.verify_tokens), texts)
                        bar.update()
                results[name] += by_phase[phase]
            finally:
                cluster.stop()
    print("phases' own p50 (the spread within a setting is the run's noise):")
    for name, xs in zip(phases, by_phase):
        print(f"  {name:3s}: TTFT {statistics.median(x[0] for x in xs) * 1e3:8.1f} ms, "
              f"TPOT {statistics.median(x[1] for x in xs) * 1e3:6.2f} ms")
    _print_on_off(results, args)


def _print_on_off(results: dict[str, list[tuple[float, ...]]], args) -> None:
    p50 = {name: [statistics.median(x[k] for x in xs) for k in range(4)] for name, xs in results.items()}
    print(f"\n{2 * args.verify_rounds} rounds x {args.verify_concurrency} concurrent requests per setting, "
          f"~{args.verify_prompt_tokens}-token prompts, {args.verify_tokens} tokens each, greedy")
    print("| verification | requests | TTFT p50 ms | TPOT p50 ms | first gap p50 ms (the read) | later gaps p50 ms |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, (ttft, tpot, first, later) in p50.items():
        print(f"| {name} | {len(results[name])} | {ttft * 1e3:.1f} | {tpot * 1e3:.2f} | {first * 1e3:.2f} | "
              f"{later * 1e3:.2f} |")
    on, off = p50["on"], p50["off"]
    print(f"\non / off: TTFT p50 {on[0] / off[0]:.3f}x, TPOT p50 {on[1] / off[1]:.3f}x (the target: within 2%); "
          f"the read's gap {(on[2] - off[2]) * 1e3:+.2f} ms, later gaps {on[3] / off[3]:.3f}x")


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
    parser.add_argument("--verify", action="store_true",
                        help="measure the transfer checksum instead: its cost per block, then TTFT/TPOT on vs off")
    parser.add_argument("--verify-prompt-tokens", type=int, default=1024)
    parser.add_argument("--verify-tokens", type=int, default=32, help="tokens generated per request")
    parser.add_argument("--verify-rounds", type=int, default=6, help="rounds in each of the four phases")
    parser.add_argument("--verify-concurrency", type=int, default=4, help="requests sent at once to a cluster")
    parser.add_argument("--verify-serving", action=argparse.BooleanOptionalAction, default=True,
                        help="with --verify: also the on/off serving run (--no-verify-serving: the checksums only)")
    parser.add_argument("--by-head", action="store_true",
                        help="measure reads by head between tensor-parallel sizes instead (benchmarks/kv_by_head.py)")
    parser.add_argument("--pairs", default="1:1,2:1,1:2,2:2,4:1,1:4", help="with --by-head: prefill:decode TP sizes")
    args = parser.parse_args(argv)
    if args.by_head:
        from benchmarks.kv_by_head import run
        run([b for b in args.backends.split(",") if b], [tuple(int(x) for x in p.split(":")) for p in args.pairs.split(",")],
            [int(s) for s in args.sizes.split(",")], args.reps)
        return
    if args.verify:
        torch.set_num_threads(args.torch_threads)
        bench_checksums(args.verify_prompt_tokens, args.reps)
        if args.verify_serving:
            bench_verify_serving(args)
        return
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
