"""``pdserve serve``'s settings flags parsed as its command line would be (tests/cluster)."""

import argparse

from pdserve.cluster.settings import add_arguments


def parse(argv):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)
