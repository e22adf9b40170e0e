"""Secrets stay out of reprs (logs, tracebacks, Ray's dashboards print configs) and out of
what ``Controller.config()`` hands to any Ray client: the API key and the TLS private keys
(issue 25). No Ray is started: the actor's method is called on its plain class."""

from types import SimpleNamespace

from pdserve.cluster.controller import Controller
from pdserve.cluster.config import ClusterConfig
from pdserve.router.server import RouterConfig
from pdserve.wire.tls import TlsConfig

KEY = "sk-very-secret-key"
TLS_KEY = b"-----BEGIN PRIVATE KEY-----\nSECRETKEYBYTES\n-----END PRIVATE KEY-----\n"
TLS = TlsConfig(cert_pem=b"CERT", key_pem=TLS_KEY, ca_pem=b"CA")


def test_the_api_key_is_not_in_the_configs_reprs():
    assert KEY not in repr(RouterConfig(api_key=KEY)) and KEY not in str(RouterConfig(api_key=KEY))
    config = ClusterConfig(api_key=KEY, tls=TLS, public_tls=TLS)
    assert KEY not in repr(config) and b"SECRETKEYBYTES".decode() not in repr(config)


def test_the_controller_hands_out_its_config_without_secrets():
    config = ClusterConfig(api_key=KEY, tls=TLS, public_tls=TLS, num_decode=3)
    controller = SimpleNamespace(cluster=SimpleNamespace(config=config))
    given = Controller.__ray_metadata__.modified_class.config(controller)
    assert given.api_key != KEY and given.tls.key_pem == b"" and given.public_tls.key_pem == b""
    assert given.num_decode == 3 and given.tls.cert_pem == b"CERT"  # the rest is as configured
    # What `pdserve serve --address` compares with the running cluster's: equal for equal settings.
    assert given == config.without_secrets() and given != ClusterConfig(num_decode=3).without_secrets()
