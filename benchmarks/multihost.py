"""TTFT and KV transfer rate with prefill and decode on two "hosts", beside one host, same run.

    sudo .venv/bin/python benchmarks/multihost.py [--lengths 512] [--repeats 5]

Two hosts: network namespaces joined by a veth pair, a Ray node in each
(tests/security/netns.py); the prefill worker on 10.77.0.1, the decode worker on 10.77.0.2, so
NIXL's read crosses the veth (UCX held to TCP, as between real hosts; the namespaces share a
kernel, so UCX would otherwise use shared memory). One host: the same driver with a Ray of its
own on this machine (UCX picks shared memory / CMA). Both run
tests/security/netns_driver.py: random prompts, one request at a time, medians; the transfer
time and bytes come from the decode worker's counters.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.security.netns import two_hosts  # noqa: E402

DRIVER = ROOT / "tests" / "security" / "netns_driver.py"


def main() -> None:
    from benchmarks.processor import print_banner

    print_banner()  # the processor and kernel path every figure below ran on
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", nargs="+", default=["512"])
    ap.add_argument("--repeats", default="5")
    args = ap.parse_args()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_AUTH_MODE": "token"}
    env.setdefault("RAY_AUTH_TOKEN", os.urandom(32).hex())
    tmp = Path(tempfile.mkdtemp(prefix="pdserve-multihost-"))
    flags = ["--questions", "--ttft-lengths", *args.lengths, "--ttft-repeats", args.repeats]
    results = {}
    subprocess.run([sys.executable, str(DRIVER), str(tmp / "one.json"), *flags], env=env, check=True)
    results["one host"] = json.loads((tmp / "one.json").read_text())
    netenv = {**env, "UCX_TLS": "tcp,self"}  # as two real hosts: no shared memory between the namespaces
    with two_hosts(netenv) as hosts:
        hosts.run("a", [sys.executable, str(DRIVER), str(tmp / "two.json"), "--ray-address", hosts.ray_address,
                        *flags], timeout=600, env=netenv, check=True)
    results["two hosts (netns)"] = json.loads((tmp / "two.json").read_text())
    print("| layout | prompt tokens | TTFT ms | KV transfer ms | KV MB | GB/s |")
    print("|---|---|---|---|---|---|")
    for name, result in results.items():
        for r in result["ttft"]:
            print(f"| {name} | {r['prompt_tokens']} | {r['ttft_s'] * 1e3:.1f} | {r['transfer_s'] * 1e3:.2f} | "
                  f"{r['bytes'] / 1e6:.1f} | {r['bytes'] / r['transfer_s'] / 1e9:.2f} |")


if __name__ == "__main__":
    main()
