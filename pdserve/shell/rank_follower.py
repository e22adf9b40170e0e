"""A rank other than 0 of a tensor-parallel *worker*: ``python -m pdserve.shell.rank_follower SPEC``.

The engine's follower (``pdserve.engine.distributed.follower``: join, load this rank's share,
follow rank 0's steps) with one service more, on a thread of its own: this rank's KV-transfer
agent, created here over this rank's own cache (its part of the shared cache file on the CPU,
its VRAM on CUDA) when rank 0 asks, and driven by rank 0 over their socket pair
(``pdserve.kv_transfer.remote_agent``). A worker starts its engine's ranks with this entry
(``RANK_ENTRY``); an engine alone (benchmarks, the planner's profile) needs no agents.
"""

from __future__ import annotations

import logging
import os
import socket
import sys

import torch

from pdserve.engine.distributed import follower
from pdserve.engine.distributed.group import FollowerSpec
from pdserve.kv_transfer.remote_agent import serve

RANK_ENTRY = "pdserve.shell.rank_follower"


def serve_agent(spec: FollowerSpec, cache: torch.Tensor, sock: socket.socket) -> None:
    """The service: answer rank 0's calls on this rank's agent until it closes it."""
    serve(sock, cache)


if __name__ == "__main__":
    code = follower.main(sys.argv, serve_agent)
    logging.shutdown()
    os._exit(code)  # as the engine's follower: the process group's threads may still run
