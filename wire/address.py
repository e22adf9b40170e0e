"""Where a server binds and what it tells peers: two addresses, never confused.

A server binds ``bind_host`` and advertises ``advertise_host`` (the address peers dial). Both
default from the node: on Ray, the node's IP as Ray knows it (``ray.util.get_node_ip_address``),
the address other nodes reach this one at. A wildcard bind (``0.0.0.0``, ``::``) is never
advertised: peers get the node's IP instead.

    endpoint = resolve(bind_host=None, advertise_host=None)   # the node's IP, both
    endpoint = resolve("0.0.0.0", None)                       # binds all, advertises the node IP
    endpoint = resolve("10.0.0.5", "node-7.internal")         # an explicit override wins
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

WILDCARDS = ("", "0.0.0.0", "::", "[::]")


@dataclass(frozen=True)
class Endpoint:
    bind_host: str
    advertise_host: str

    def advertise(self, port: int) -> str:
        """``host:port`` for peers (IPv6 hosts in brackets)."""
        host = self.advertise_host
        return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def node_ip() -> str:
    """This node's address as its peers reach it: inside a Ray process, the address its raylet
    registered (``ray start --node-ip-address``); else the address of the interface that routes
    outward (no packet is sent: UDP connect only picks a route), or loopback with no route."""
    try:
        import ray

        if ray.is_initialized():
            return _ray_node_ip(ray)
    except ImportError:
        pass
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.254.254.254", 1))
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def _ray_node_ip(ray) -> str:
    # Inside an actor ray.util.get_node_ip_address() guesses from the routing table, which is
    # not the node's address when a host has several (a namespace without a default route, a
    # node started with --node-ip-address). The GCS's record of this node is.
    node_id = ray.get_runtime_context().get_node_id()
    for node in ray.nodes():
        if node["NodeID"] == node_id:
            return node["NodeManagerAddress"]
    return ray.util.get_node_ip_address()


def resolve(bind_host: str | None, advertise_host: str | None = None) -> Endpoint:
    """The endpoint for a server asked to bind ``bind_host`` (None: the node's IP) and to
    advertise ``advertise_host`` (None: the bind host, or the node's IP for a wildcard)."""
    bind = node_ip() if bind_host is None else bind_host
    if advertise_host:
        return Endpoint(bind, advertise_host)
    return Endpoint(bind, node_ip() if bind in WILDCARDS else bind)


def split(address: str) -> tuple[str, int]:
    """``host:port`` -> (host, port); brackets of an IPv6 host are dropped."""
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def transfer_listen_opts(backend: str, endpoint: Endpoint) -> dict[str, str]:
    """``create_agent`` options naming where a KV-transfer backend's own listener binds and
    what it advertises. Only the tcp block server has one; NIXL's metadata travels over the
    worker's gRPC (internal plane) and its data over UCX."""
    if backend != "tcp":
        return {}
    return {"host": endpoint.bind_host, "advertise_host": endpoint.advertise_host}
