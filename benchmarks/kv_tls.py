"""What mTLS costs the tcp KV backend: read rate with and without it, same run.

    .venv/bin/python benchmarks/kv_tls.py [--blocks 32] [--repeats 15]

Two holder/reader pairs of tcp agents in this process over loopback, one plaintext, one with
the internal plane's mTLS (a CA from pdserve/cluster/certs.py, contexts from pdserve/wire/tls.py); the same
scattered-block read goes to them in turn, A B A B, so the machine's load falls on both alike.
Default block: SmolLM2-135M in bf16 (368,640 bytes, as benchmarks/kv_transfer.py); 32 blocks
is a 512-token prompt. Reports the median time per read and GB/s (1e9 bytes per second).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402

from pdserve.cluster.certs import issue, make_ca  # noqa: E402
from pdserve.kv_transfer import TransferState, create_agent  # noqa: E402
from pdserve.wire import tls  # noqa: E402

BLOCK_SHAPE = (30, 2, 16, 3, 64)  # layers, K/V, tokens, kv heads, head dim: 368,640 bytes in bf16


def certificates(out: Path) -> dict[str, tls.TlsConfig]:
    ca = make_ca(out)
    return {name: tls.load(str(i.cert), str(i.key), str(ca.cert), prefix="tls")
            for name, i in ((n, issue(ca, out, n)) for n in ("prefill", "decode"))}


def timed_read(reader, peer: str, blocks: int, num_blocks: int) -> float:
    remote = random.sample(range(num_blocks), blocks)
    local = random.sample(range(num_blocks), blocks)
    start = time.perf_counter()
    state = reader.wait(reader.start_read(peer, remote, local), 60)
    elapsed = time.perf_counter() - start
    if state is not TransferState.DONE:
        raise RuntimeError(f"read ended {state.name}")
    return elapsed


def main() -> None:
    from benchmarks.processor import print_banner

    print_banner()  # the processor and kernel path every figure below ran on
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    num_blocks = args.blocks * 4
    cache = lambda: torch.randn((num_blocks, *BLOCK_SHAPE)).to(torch.bfloat16)
    certs = certificates(Path(tempfile.mkdtemp(prefix="pdserve-kv-tls-")))
    pairs = {}
    for label, holder_tls, reader_tls in (("plaintext", None, None),
                                          ("mTLS", certs["prefill"], certs["decode"])):
        holder = create_agent("tcp", f"holder-{label}", cache(), tls=holder_tls)
        reader = create_agent("tcp", f"reader-{label}", cache(), tls=reader_tls)
        pairs[label] = (holder, reader, reader.add_remote(holder.local_metadata()))
    nbytes = args.blocks * pairs["plaintext"][0].layout.block_bytes
    times = {label: [] for label in pairs}
    try:
        for label, (_, reader, peer) in pairs.items():  # warm-up: connections, page faults
            timed_read(reader, peer, args.blocks, num_blocks)
        for _ in range(args.repeats):
            for label, (_, reader, peer) in pairs.items():
                times[label].append(timed_read(reader, peer, args.blocks, num_blocks))
    finally:
        for holder, reader, _ in pairs.values():
            reader.close()
            holder.close()
    print(f"{args.blocks} blocks = {nbytes / 1e6:.1f} MB per read, {args.repeats} reads each, alternating")
    print("| tcp KV path | median ms | min ms | max ms | GB/s (median) |")
    print("|---|---|---|---|---|")
    for label, ts in times.items():
        med = statistics.median(ts)
        print(f"| {label} | {med * 1e3:.1f} | {min(ts) * 1e3:.1f} | {max(ts) * 1e3:.1f} | {nbytes / med / 1e9:.2f} |")
    ratio = statistics.median(times["mTLS"]) / statistics.median(times["plaintext"])
    print(f"mTLS / plaintext, median time per read: {ratio:.2f}x")


if __name__ == "__main__":
    main()
