"""The gRPC face of a decode worker's held prefixes (``pdserve.decode_worker.prefix_hold``):
``HoldPrefix`` for the router, then ``Claim``, ``Release`` and ``GetAgentMetadata`` for the
prefill worker that reads the prefix, answered as a prefill worker answers them for its held
KV (``pdserve.prefill_worker.service``). A mixin of ``DecodeService``."""

from __future__ import annotations

import logging

from pdserve.kv_transfer.handoff import reason_from_wire
from pdserve.protos import worker_pb2
from pdserve.shell.lease_rpcs import answer_claim

log = logging.getLogger(__name__)


class PrefixHoldRpcs:
    """Needs ``self.worker`` (a ``DecodeWorker``) and ``self.address`` (the address a reader
    dials: the handle names it)."""

    async def HoldPrefix(self, request, context):
        """The handle of the prompt's cached prefix, held for a prefill worker; empty when
        nothing is cached or holds are refused here. A draining worker holds nothing."""
        if self.worker.draining:
            return worker_pb2.HoldPrefixResponse()
        holds = self.worker.prefix_holds
        kv = await self.worker.call(holds.hold, self.address, list(request.prompt_token_ids), request.cache_salt,
                                    request.router_id)
        if kv is None:
            return worker_pb2.HoldPrefixResponse()
        log.debug("hold %s: %d prefix tokens in %d blocks", request.request_id, kv.num_tokens, len(kv.block_ids))
        return worker_pb2.HoldPrefixResponse(kv=kv.to_proto())

    async def Claim(self, request, context):
        holds = self.worker.prefix_holds

        async def claim():  # the table has its own lock: answered here on the loop, as a prefill worker does
            return holds.claim(request.lease_token, list(request.block_ids), request.renew)

        return await answer_claim(context, claim, holds.lease_seconds)

    async def Release(self, request, context):
        reason = reason_from_wire(request.reason)
        holds = self.worker.prefix_holds
        if not reason.ends_lease:  # a give-back is table bookkeeping, answered here
            released = holds.table.release(request.lease_token, reason) is not None
        else:
            released = await self.worker.call(holds.release, request.lease_token, reason)
        return worker_pb2.ReleaseResponse(released=released)

    async def GetAgentMetadata(self, request, context):
        return self.worker.agent.local_metadata()
