"""The answer to a ``Claim`` RPC, for every holder of KV under leases: a prefill worker's held
prompts (``pdserve.prefill_worker.service``) and a decode worker's held prefixes
(``pdserve.decode_worker.prefix_rpcs``). The rules are the lease table's
(``pdserve.kv_transfer.handoff``); this is only how a refusal travels."""

from __future__ import annotations

from typing import Awaitable, Callable

import grpc

from pdserve.kv_transfer.handoff import Lease, LeaseRefused
from pdserve.protos import worker_pb2
from pdserve.wire.failure import Failure, abort_with


async def answer_claim(context: grpc.aio.ServicerContext, claim: Callable[[], Awaitable[Lease | None]],
                       lease_seconds: float) -> worker_pb2.ClaimResponse:
    """``claim()``'s answer: how long the claim lasts; FAILED_PRECONDITION (nothing changed)
    when the table refuses it (LeaseRefused, naming why) or a renewal finds no claimed lease."""
    try:
        lease = await claim()
    except LeaseRefused as exc:
        await abort_with(context, grpc.StatusCode.FAILED_PRECONDITION, Failure.KV_TRANSFER,
                         f"lease refused ({exc.reason}): {exc}")
    if lease is None:
        await abort_with(context, grpc.StatusCode.FAILED_PRECONDITION, Failure.KV_TRANSFER,
                         "renewal refused: the lease has ended or is not claimed")
    return worker_pb2.ClaimResponse(lease_seconds=lease_seconds)
