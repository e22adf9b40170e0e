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

import fcntl
import ipaddress
import socket
import struct
from dataclasses import dataclass
from typing import Any

from pdserve.wire.tls import TlsConfig

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


def transfer_listen_opts(backend: str, endpoint: Endpoint, tls: TlsConfig | None = None) -> dict[str, Any]:
    """``create_agent`` options that keep a KV-transfer backend's own listeners on the internal
    plane. The tcp block server binds the endpoint's bind host, advertises its advertised host
    and takes the plane's mTLS. NIXL's metadata travels over the worker's gRPC (internal
    plane); UCX listens on every interface it may use, so it is held to the interface that
    carries the bind host (``net_devices``; none for a wildcard or an address no interface has)."""
    if backend == "tcp":
        return {"host": endpoint.bind_host, "advertise_host": endpoint.advertise_host, "tls": tls}
    if backend == "nixl":
        device = interface_of(endpoint.bind_host)
        return {"net_devices": device} if device else {}
    return {}


_SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address


def interface_of(host: str) -> str | None:
    """The name of the network interface that has address ``host`` (any loopback address:
    the loopback interface), or None for a wildcard, a host name, IPv6, or an address that
    no interface has."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None
    if ip.version != 4 or ip.is_unspecified:
        return None
    for _, name in socket.if_nameindex():
        address = _ipv4_of(name)
        if address is not None and (address == ip or (address.is_loopback and ip.is_loopback)):
            return name
    return None


def _ipv4_of(name: str) -> ipaddress.IPv4Address | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError:  # no IPv4 address on it
            return None
    return ipaddress.IPv4Address(packed[20:24])
