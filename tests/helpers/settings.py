"""``pdserve serve``'s settings flags parsed as its command line would be (tests/cluster)."""

import argparse

from pdserve.cluster.settings import add_arguments


def parse(argv):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def worker(role, argv):
    """``pdserve worker --role ROLE``'s typed settings with ``argv``'s flags (no environment)."""
    from pdserve.cluster import worker_cli

    parser = argparse.ArgumentParser()
    add_arguments(parser, worker_cli.worker_settings())
    admin = ["--router-admin", "127.0.0.1:1"] if role != "router" else []
    return worker_cli.settings(parser.parse_args(["--role", role, *admin, *argv]), environ={})
