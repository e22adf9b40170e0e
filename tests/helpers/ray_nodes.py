"""Ray nodes that tests start themselves with ``ray start`` (the multi-node placement and the
detached controller tests): the ``ray`` beside this interpreter, the environment it runs in,
and a free port for its head."""

import os
import socket
import sys
from pathlib import Path

RAY = str(Path(sys.executable).parent / "ray")
# Both nodes run with token authentication and share the test session's token (RAY_AUTH_MODE and
# RAY_AUTH_TOKEN come from tests/conftest.py through the environment).
ENV = dict(os.environ)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
