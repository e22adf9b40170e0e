"""One test CA and a certificate of it for each component (``pdserve.cluster.certs``), loaded as
the internal plane's ``TlsConfig``s: what a test needs to run real workers under mTLS."""

from pathlib import Path

from pdserve.cluster.certs import COMPONENTS, issue, make_ca
from pdserve.wire import tls


def role_certs(out: Path, hosts: dict[str, tuple[str, ...]] | None = None) -> dict[str, tls.TlsConfig]:
    """Component name -> its certificate, all of one CA made in ``out``. ``hosts``: more
    certificates, each named by its key and holding the roles of the component its name starts
    with ("decode-a": decode's), naming those hosts (a worker bound to its address)."""
    ca = make_ca(out)
    issued = {name: issue(ca, out, name) for name in COMPONENTS}
    for name, names in (hosts or {}).items():
        issued[name] = issue(ca, out, name.split("-")[0], extra_names=names, stem=name)
    return {name: tls.load(str(i.cert), str(i.key), str(ca.cert), prefix="tls") for name, i in issued.items()}
