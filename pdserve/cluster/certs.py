"""Make a test CA and per-component certificates for the internal plane's mTLS.

    python -m pdserve.cluster.certs DIR [--components router prefill decode controller] [--days 30]

writes ``DIR/ca.pem`` (and ``ca.key``, keep it off the cluster), and for each component
``DIR/<name>.pem`` + ``DIR/<name>.key``. Every component certificate is both a server and a
client certificate and names its roles twice (``pdserve.wire.tls``): as SAN URIs
``spiffe://pdserve/<role>``, which a server reads to decide which RPCs the caller may make
(``pdserve.wire.internal_plane``), and as DNS names ``<role>.pdserve.internal``, which a channel
checks to know the server it reached serves the role it meant to call. A component has one
role, but ``elastic`` (an elastic worker, which serves both pools' RPCs and changes between
them in place) has two: prefill and decode. Then: ``pdserve serve --tls-dir DIR``.

``--worker NAME=ROLE@HOST[,HOST...]`` (repeatable) also makes ``NAME.pem``: a plain-process
worker's own certificate (``pdserve worker``), naming its role and the hosts it serves at (IPs
or DNS names). The router lets a worker join and leave its table only at an address on a host
its certificate names (``pdserve.router.admin``), so one worker's certificate cannot add, move
or drop another; the shared ``prefill``/``decode`` certificates name no host and serve
``pdserve serve``'s workers, which the controller lists.

``--public-names`` also makes ``public.pem``: a server-only certificate for the public API,
without ``pdserve.internal`` and without clientAuth, so that whoever holds the ingress key
cannot call the internal plane with it.

For production use a real CA; this one is for tests and trials (EC P-256, short-lived).
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from pdserve.wire.tls import role_name, role_uri

# Each component's roles on the internal plane (wire.internal_plane.ROLES).
COMPONENT_ROLES = {"router": ("router",), "prefill": ("prefill",), "decode": ("decode",),
                   "controller": ("controller",), "elastic": ("prefill", "decode")}
COMPONENTS = tuple(COMPONENT_ROLES)


@dataclass(frozen=True)
class Issued:
    cert: Path
    key: Path


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "pdserve"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write(out: Path, stem: str, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> Issued:
    cert_path, key_path = out / f"{stem}.pem", out / f"{stem}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.touch(mode=0o600)
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return Issued(cert_path, key_path)


def make_ca(out: Path, days: int = 30, name: str = "pdserve test CA") -> Issued:
    """A self-signed CA in ``out/ca.pem`` / ``out/ca.key``."""
    out.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(_name(name)).issuer_name(_name(name))
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    return _write(out, "ca", cert, key)


def issue(ca: Issued, out: Path, component: str, days: int = 30, extra_names: tuple[str, ...] = (),
          public: bool = False, stem: str | None = None) -> Issued:
    """A certificate for ``component`` signed by ``ca``, valid as server and client, naming
    the component's roles (``COMPONENT_ROLES``; a name not listed there is one role of its own
    name) and ``extra_names`` (host names or IPs: for a worker, the hosts it may join the
    router's table at, ``router.admin``). ``public``: a server-only certificate naming
    ``extra_names`` alone (the public API's). Written as ``out/<stem>.pem`` (default: the
    component's name)."""
    ca_cert = x509.load_pem_x509_certificate(ca.cert.read_bytes())
    ca_key = serialization.load_pem_private_key(ca.key.read_bytes(), password=None)
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    names: list[x509.GeneralName] = []
    if not public:
        for role in COMPONENT_ROLES.get(component, (component,)):
            names += [x509.UniformResourceIdentifier(role_uri(role)), x509.DNSName(role_name(role))]
    for extra in extra_names:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(extra)))
        except ValueError:
            names.append(x509.DNSName(extra))
    cert = (x509.CertificateBuilder().subject_name(_name(f"pdserve-{component}")).issuer_name(ca_cert.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH] if public else
                                                 [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    return _write(out, stem or component, cert, key)


def worker_spec(spec: str) -> tuple[str, str, tuple[str, ...]]:
    """``NAME=ROLE@HOST[,HOST...]`` -> (name, role, hosts); ValueError naming what is wrong."""
    name, _, rest = spec.partition("=")
    role, _, hosts = rest.partition("@")
    named = tuple(h for h in hosts.split(",") if h)
    if not name or role not in ("prefill", "decode") or not named:
        raise ValueError(f"--worker: expected NAME=ROLE@HOST[,HOST...] with ROLE prefill or decode and at "
                         f"least one host, got {spec!r}")
    if name in COMPONENTS or name in ("ca", "public"):
        raise ValueError(f"--worker: NAME {name!r} is a component's own file name; choose another")
    return name, role, named


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pdserve.cluster.certs", description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--components", nargs="+", default=list(COMPONENTS))
    parser.add_argument("--days", type=int, default=30)
    parser.add_argument("--public-names", nargs="*", default=[],
                        help="also make public.pem/public.key for these host names or IPs (public API TLS)")
    parser.add_argument("--worker", action="append", default=[], metavar="NAME=ROLE@HOST[,HOST...]",
                        help="also make NAME.pem/NAME.key: one worker's certificate, naming ROLE and the hosts "
                             "it serves at, where alone the router lets it join (repeatable)")
    args = parser.parse_args(argv)
    try:
        workers = [worker_spec(spec) for spec in args.worker]
    except ValueError as exc:
        parser.error(str(exc))
    ca = make_ca(args.out, args.days)
    for component in args.components:
        issue(ca, args.out, component, args.days)
    for name, role, hosts in workers:
        issue(ca, args.out, role, args.days, hosts, stem=name)
    if args.public_names:
        issue(ca, args.out, "public", args.days, tuple(args.public_names), public=True)
    print(f"wrote {ca.cert}, {len(args.components)} component and {len(workers)} worker certificate(s) to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
