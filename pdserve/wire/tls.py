"""TLS for every gRPC server and channel, and for the public HTTP API: the one place that
turns certificate files into credentials.

Two uses:

- **Internal plane (mTLS).** ``TlsConfig(ca, cert, key)``: every internal server (router admin,
  every worker) asks for a client certificate signed by ``ca`` and refuses a connection
  without one; every internal channel presents ``cert`` and checks the server against ``ca``.
  Internal servers sit at addresses only known at run time (Ray picks the node, the port is
  free-picked), so certificates do not name addresses but roles: each role a certificate
  holds as a SAN URI ``spiffe://pdserve/<role>`` (``role_uri``; what a server checks of its
  caller, ``certificate_roles``) and as a DNS name ``<role>.pdserve.internal`` (``role_name``;
  what a channel checks of the server it reached, ``grpc.ssl_target_name_override``). So a
  channel to a prefill worker fails its handshake with any server that is not one, whoever
  signed its certificate. A plain-process worker's certificate also names the hosts it serves
  at (IP or DNS SANs, ``certificate_hosts``): the router lets it join and leave its table only
  at an address on one of them (``pdserve.router.admin``).
- **Public plane (TLS).** ``TlsConfig(cert, key, ca=None)``: a server certificate for the public
  gRPC and HTTP ports; with ``ca`` set, clients must present a certificate signed by it.

Servers and clients that are not gRPC (the public HTTP API, the tcp KV block server and its
readers) take ``ssl`` contexts made here by the same rules (``server_context``,
``client_context``).

The PEM bytes are read once, where the config is built (``load``), so a config can travel to a
Ray actor on another node that lacks the files. ``scripts/make_certs.py`` makes a test CA and
per-component certificates.
"""

from __future__ import annotations

import functools
import ipaddress
import ssl
import tempfile
from dataclasses import dataclass
from pathlib import Path

import grpc

INTERNAL_DOMAIN = "pdserve.internal"
ROLE_URI_PREFIX = "spiffe://pdserve/"


def role_name(role: str) -> str:
    """The DNS name a certificate of ``role`` carries, and a channel to ``role`` checks."""
    return f"{role}.{INTERNAL_DOMAIN}"


def role_uri(role: str) -> str:
    """The SAN URI that names ``role`` in a certificate, which servers read of their callers."""
    return ROLE_URI_PREFIX + role


def _sans(pem: bytes):
    """The SubjectAlternativeName of a PEM certificate; None for one without (or not a certificate)."""
    from cryptography import x509

    try:
        cert = x509.load_pem_x509_certificate(pem)
        return cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (ValueError, x509.ExtensionNotFound):
        return None


@functools.lru_cache(maxsize=256)
def certificate_roles(pem: bytes) -> frozenset[str]:
    """The roles a PEM certificate names as SAN URIs (``role_uri``); none for one that names none.
    Cached: a server reads its callers' few certificates at every call."""
    from cryptography import x509

    sans = _sans(pem)
    if sans is None:
        return frozenset()
    uris = sans.get_values_for_type(x509.UniformResourceIdentifier)
    return frozenset(u[len(ROLE_URI_PREFIX):] for u in uris if u.startswith(ROLE_URI_PREFIX))


def _host_key(host: str) -> str:
    """A host as certificates and addresses are compared: an IP in its canonical form, a DNS
    name in lower case without a final dot."""
    bare = host.strip("[]")
    try:
        return str(ipaddress.ip_address(bare))
    except ValueError:
        return bare.lower().rstrip(".")


@functools.lru_cache(maxsize=256)
def certificate_hosts(pem: bytes) -> frozenset[str]:
    """The hosts a PEM certificate names besides its roles: its IP SANs and its DNS names outside
    ``INTERNAL_DOMAIN`` (the role names are not hosts). A worker's certificate names the hosts
    it serves at, and the router lets it join its table only there (``router.admin``)."""
    from cryptography import x509

    sans = _sans(pem)
    if sans is None:
        return frozenset()
    names = [_host_key(n) for n in sans.get_values_for_type(x509.DNSName)]
    ips = [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)]
    return frozenset(n for n in names if not n.endswith("." + INTERNAL_DOMAIN)) | frozenset(ips)


def names_host(pem: bytes, host: str) -> bool:
    """Whether the certificate ``pem`` names ``host`` (``certificate_hosts``; an IPv6 host may be
    in brackets)."""
    return _host_key(host) in certificate_hosts(pem)


class TlsConfigError(ValueError):
    """A TLS setting is incomplete or a file cannot be read; the message names the setting."""


@dataclass(frozen=True)
class TlsConfig:
    cert_pem: bytes  # this component's certificate chain
    key_pem: bytes = b""
    ca_pem: bytes | None = None  # peers must be signed by this; None (public plane only): no client certs

    def __repr__(self) -> str:  # never print the key
        return f"TlsConfig(roles={sorted(certificate_roles(self.cert_pem))}, client_certs={self.ca_pem is not None})"

    @property
    def requires_client_cert(self) -> bool:
        return self.ca_pem is not None

    def server_credentials(self) -> grpc.ServerCredentials:
        """Serve with ``cert``; with a CA, refuse clients without a certificate it signed."""
        return grpc.ssl_server_credentials([(self.key_pem, self.cert_pem)], root_certificates=self.ca_pem,
                                           require_client_auth=self.ca_pem is not None)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Present ``cert`` and trust only servers signed by the CA."""
        return grpc.ssl_channel_credentials(root_certificates=self.ca_pem, private_key=self.key_pem,
                                            certificate_chain=self.cert_pem)

    def channel_options(self, peer: str) -> list[tuple[str, str]]:
        """A channel's options to a server of role ``peer``: its certificate must name it."""
        return [("grpc.ssl_target_name_override", role_name(peer))]

    def server_context(self) -> ssl.SSLContext:
        """An ``ssl`` server context with the same certificate and the same rule as
        ``server_credentials``: with a CA, a client without a certificate it signed fails the
        handshake. For servers that are not gRPC: the public HTTP API, the tcp KV block server."""
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self._load_chain(ctx)
        if self.ca_pem is not None:
            ctx.load_verify_locations(cadata=self.ca_pem.decode())
            ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx

    http_server_context = server_context  # the public HTTP API's name for it

    def client_context(self) -> ssl.SSLContext:
        """An ``ssl`` client context with the rules of ``channel_credentials``: present
        ``cert``, trust only servers signed by the CA; wrap sockets with
        ``server_hostname=role_name(<the role expected>)``. For the tcp KV reader."""
        if self.ca_pem is None:
            raise TlsConfigError("tls_ca must be set: an internal client trusts only the cluster's CA")
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cadata=self.ca_pem.decode())
        self._load_chain(ctx)
        return ctx

    def _load_chain(self, ctx: ssl.SSLContext) -> None:
        with tempfile.TemporaryDirectory() as tmp:  # ssl loads keys only from files
            cert, key = Path(tmp) / "cert.pem", Path(tmp) / "key.pem"
            cert.write_bytes(self.cert_pem)
            key.touch(mode=0o600)
            key.write_bytes(self.key_pem)
            ctx.load_cert_chain(cert, key)


def peer_roles(sock: ssl.SSLSocket) -> frozenset[str]:
    """The roles the certificate of the peer of a verified ``ssl`` socket names
    (``certificate_roles``): what a server that is not gRPC (the tcp KV block server) checks
    of its caller."""
    der = sock.getpeercert(binary_form=True)
    return certificate_roles(ssl.DER_cert_to_PEM_cert(der).encode()) if der else frozenset()


def check_role(config: TlsConfig | None, role: str, setting: str) -> TlsConfig | None:
    """``config``, if its certificate names ``role`` (the SAN URI ``role_uri(role)``); refused at
    start otherwise, where a certificate of an older layout would fail every call."""
    if config is not None and role not in certificate_roles(config.cert_pem):
        named = ", ".join(sorted(certificate_roles(config.cert_pem))) or "no role"
        raise TlsConfigError(f"{setting}: the certificate names {named}, not {role} (a SAN URI {role_uri(role)}); "
                             f"issue it with python -m pdserve.cluster.certs")
    return config


def load(cert: str | None, key: str | None, ca: str | None, *, prefix: str,
         require_ca: bool = True) -> TlsConfig | None:
    """Read ``cert``/``key``/``ca`` files into a ``TlsConfig``; None when none is named.

    ``prefix`` is the settings' common name (``tls`` or ``public_tls``) for the errors. On the
    internal plane (``require_ca``) all three are needed: mTLS without a CA would accept anyone.
    """
    named = {f"{prefix}_cert": cert, f"{prefix}_key": key, f"{prefix}_ca": ca}
    if not any(named.values()):
        return None
    needed = [f"{prefix}_cert", f"{prefix}_key"] + ([f"{prefix}_ca"] if require_ca else [])
    missing = [name for name in needed if not named[name]]
    if missing:
        raise TlsConfigError(f"{', '.join(missing)} must be set together with "
                             f"{', '.join(n for n, v in named.items() if v)}")
    return TlsConfig(cert_pem=_read(cert, f"{prefix}_cert"), key_pem=_read(key, f"{prefix}_key"),
                     ca_pem=_read(ca, f"{prefix}_ca") if ca else None)


def _read(path: str, setting: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise TlsConfigError(f"{setting}: cannot read {path}: {exc.strerror}") from exc
    if b"-----BEGIN" not in data:
        raise TlsConfigError(f"{setting}: {path} is not a PEM file")
    return data
