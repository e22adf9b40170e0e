import socket
from contextlib import ExitStack

import pytest


@pytest.fixture
def free_ports():
    """``free_ports(n)``: n distinct loopback ports that were free a moment ago."""

    def pick(n: int) -> list[int]:
        with ExitStack() as stack:
            socks = [stack.enter_context(socket.socket()) for _ in range(n)]
            for s in socks:
                s.bind(("127.0.0.1", 0))
            return [s.getsockname()[1] for s in socks]

    return pick
