"""``pdserve serve``'s security settings are checked before anything starts: a half-named TLS
setting or an unreadable key file is exit code 2 with the setting named, and the API key comes
from the PDSERVE_API_KEY variable as from the flag."""

import argparse

import pytest

from pdserve.cluster import cli
from pdserve.cluster.settings import add_arguments, resolve


def serve_args(argv):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


@pytest.mark.parametrize("argv, message", [
    (["--tls-cert", "c.pem"], "tls_key, tls_ca must be set together with tls_cert"),
    (["--public-tls-key", "k.pem"], "public_tls_cert must be set together with public_tls_key"),
    (["--api-key-file", "/nonexistent/key"], "api_key_file: cannot read /nonexistent/key"),
    (["--api-key", "a", "--api-key-file", "f"], "api_key and api_key_file are both set"),
])
def test_bad_security_settings_fail_before_start(argv, message, capsys):
    assert cli.serve(serve_args(argv)) == 2
    assert message in capsys.readouterr().err


def test_api_key_from_the_environment():
    v = resolve(serve_args([]), environ={"PDSERVE_API_KEY": "from-env"})
    assert v.api.api_key == "from-env"
    assert resolve(serve_args(["--api-key", "flag"]), environ={"PDSERVE_API_KEY": "env"}).api.api_key == "flag"
