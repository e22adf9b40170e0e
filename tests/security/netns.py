"""Two "hosts" on this machine: network namespaces joined by a veth pair, each with a Ray node.

    with two_hosts() as hosts:          # needs root (ip netns)
        hosts.run("a", [python, "driver.py", ...])   # a command inside host a's namespace

Host a is ``10.77.0.1`` and runs the Ray head (with the custom resource ``prefill_nodes``);
host b is ``10.77.0.2`` and runs a second Ray node (``decode_nodes``). Each namespace has only
its loopback and its end of the veth, so a server reachable from the other host must bind its
namespace's veth address, and one advertising ``127.0.0.1`` points the peer at itself. A
default route through the veth lets Ray and our ``pdserve.wire.address`` find each node's address; no
other network is reachable from inside.

Everything started inside is found again through ``ip netns pids`` and killed on the way out,
then the namespaces (and with them the veth pair) are deleted.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

RAY = str(Path(sys.executable).parent / "ray")
ADDRESSES = {"a": "10.77.0.1", "b": "10.77.0.2"}
RESOURCES = {"a": '{"prefill_nodes": 8}', "b": '{"decode_nodes": 8}'}
GCS_PORT = 6379  # inside host a's namespace: no other process on this machine shares its ports


@dataclass(frozen=True)
class Hosts:
    namespaces: dict[str, str]  # host -> namespace name
    veth: dict[str, str]  # host -> its end of the veth pair
    temp_dir: str

    @property
    def ray_address(self) -> str:
        return f"{ADDRESSES['a']}:{GCS_PORT}"

    def command(self, host: str, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.namespaces[host], *argv]

    def run(self, host: str, argv: list[str], timeout: float, **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(host, argv), timeout=timeout, **kwargs)

    def tx_bytes(self, host: str) -> int:
        """Bytes sent by ``host``'s end of the veth (everything that left it for the other host)."""
        out = subprocess.run(["ip", "netns", "exec", self.namespaces[host], "cat",
                              f"/sys/class/net/{self.veth[host]}/statistics/tx_bytes"],
                             capture_output=True, text=True, check=True).stdout
        return int(out)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


def _kill_namespace(name: str) -> None:
    """Kill every process in namespace ``name`` (all of them were started by us)."""
    for _ in range(3):
        pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout.split()
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.5)


@contextmanager
def two_hosts(env: dict[str, str], num_cpus: int = 2):
    tag = secrets.token_hex(3)
    hosts = Hosts({"a": f"pdsa{tag}", "b": f"pdsb{tag}"}, {"a": f"vpa{tag}", "b": f"vpb{tag}"},
                  f"/tmp/pdsn{tag}")
    created = []
    try:
        for host in ("a", "b"):
            _ip("netns", "add", hosts.namespaces[host])
            created.append(hosts.namespaces[host])
        _ip("link", "add", hosts.veth["a"], "type", "veth", "peer", "name", hosts.veth["b"])
        for host in ("a", "b"):
            ns, dev = hosts.namespaces[host], hosts.veth[host]
            _ip("link", "set", dev, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{ADDRESSES[host]}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "route", "add", "default", "dev", dev)
        common = [f"--num-cpus={num_cpus}", "--disable-usage-stats", f"--temp-dir={hosts.temp_dir}"]
        hosts.run("a", [RAY, "start", "--head", f"--port={GCS_PORT}", f"--node-ip-address={ADDRESSES['a']}",
                        "--include-dashboard=false", f"--resources={RESOURCES['a']}", *common],
                  timeout=180, env=env, check=True, capture_output=True)
        hosts.run("b", [RAY, "start", f"--address={hosts.ray_address}", f"--node-ip-address={ADDRESSES['b']}",
                        f"--resources={RESOURCES['b']}", *common],
                  timeout=180, env=env, check=True, capture_output=True)
        yield hosts
    finally:
        for ns in created:
            _kill_namespace(ns)
        for ns in created:
            subprocess.run(["ip", "netns", "delete", ns], capture_output=True)
        subprocess.run(["rm", "-rf", hosts.temp_dir], capture_output=True)
