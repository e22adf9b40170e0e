"""One attempt at a request, in one of three kinds. An attempt yields the prefill answer (its
first token) and then the decode outputs, until the request's run has what it needs and
closes it; closing it ends its calls and frees what it holds.

- ``RemotePrefill``: a prefill worker computes the prompt and holds its KV under a lease; a
  decode worker reads the KV and goes on. With streamed KV (``stream_kv_min_tokens``) the
  decode stream opens as soon as the prompt has blocks, and reads them while prefill runs.
  With ``prefix_from`` (the reversed pull), the decode worker there first holds the prompt's
  cached prefix, and the prefill worker reads it and computes only the rest
  (``pdserve.router.prefill_call.hold_prefix``).
- ``LocalPrefill``: the decode worker prefills the prompt itself (colocated mode, or the
  local-prefill rule, ``pdserve.router.local_prefill``); its stream's first message is the
  prefill answer (``DecodeResponse.prefilled``).
- ``MovedKV``: the previous attempt's decode worker handed the stream over with its KV (an
  elastic worker changing role); another decode worker reads that KV as a prompt's and decodes
  on from the last token sent. No prefill answer: the stream goes on where it stopped.

A run makes a new attempt after a lost one, with the output sent so far appended to the
prompt (``Attempt``); after a move, all of it but the last token, which is the decode
worker's first (``moved_params``)."""

from __future__ import annotations

import dataclasses
import secrets
from dataclasses import dataclass
from typing import AsyncIterator, Union

from pdserve.engine.sampling.grammar import resumed
from pdserve.engine.sampling.params import SamplingParams
from pdserve.kv_transfer.handoff import ReleaseReason, release_request
from pdserve.protos import pdserve_pb2, worker_pb2, worker_pb2_grpc
from pdserve.router.decode_call import decode
from pdserve.router.errors import AttemptLost
from pdserve.router.prefill_call import hold_prefix, prefill, release_hold_later, streamed_answer
from pdserve.router.worker_calls import CallContext, Started, detach, ignore_errors

Output = Union[worker_pb2.PrefillResponse, worker_pb2.DecodeResponse]


@dataclass(frozen=True)
class Attempt:
    """What one attempt sends to its workers: one sampling message for both calls."""

    worker_rid: str  # ``attempt_id``
    prompt: list[int]  # the client's prompt, then the tokens it was sent before this attempt
    sampling: pdserve_pb2.SamplingParams
    blocks: int  # KV blocks to count on a decode worker: the prompt and the output reserved
    # The decode worker the attempt's plan is for (router.local_prefill: it caches the prompt's
    # longest prefix, or served the session last): its decode call tries it first. None: the
    # decode call picks the least loaded, as without a plan.
    decode_worker: str | None = None
    # That decode worker's verify_kv_transfers (None: not known, or no plan): the prefill call
    # picks a prefill worker that agrees (``pdserve.router.policy.verify_agrees``).
    verify_kv: bool | None = None


def attempt_params(params: SamplingParams, sent: int) -> SamplingParams:
    """The request's parameters for an attempt after ``sent`` tokens went out: the rest of
    the output, min_tokens counting what was sent, the prompt logprobs only on the first
    attempt that answers (they went out with the first token), a grammar resumed past the
    sent tokens, and no stop strings (only the router applies them)."""
    return dataclasses.replace(params, stop=(), max_tokens=params.max_tokens - sent,
                               min_tokens=max(0, params.min_tokens - sent),
                               prompt_logprobs=params.prompt_logprobs if not sent else None,
                               structured=resumed(params.structured, sent))


def moved_params(params: SamplingParams, sent: int) -> SamplingParams:
    """The parameters for an attempt that goes on from moved KV after ``sent`` tokens: the
    last one sent is the attempt's first output (as a prefill answer's token is), so it counts
    as ``sent - 1`` before it; its prompt logprobs went out long ago."""
    return dataclasses.replace(attempt_params(params, sent - 1), prompt_logprobs=None)


def attempt_id(request_id: str, attempt: int) -> str:
    """The id the workers know one attempt of a request by: the client's id and the attempt
    number (for logs), then 16 random bytes that only the router and the workers of this
    attempt learn. Workers key the engine's sequence, the stream and ``Abort`` on it, so an
    ``Abort`` or a second ``Decode`` naming a client's request id (clients choose ids), or
    another router's request of the same id, reaches nothing of this attempt."""
    return f"{request_id}#{attempt}.{secrets.token_urlsafe(16)}"


class LocalPrefill:
    """The decode worker prefills the prompt itself."""

    label = "local"

    async def outputs(self, ctx: CallContext, attempt: Attempt) -> AsyncIterator[Output]:
        request = worker_pb2.DecodeRequest(request_id=attempt.worker_rid, prompt_token_ids=attempt.prompt,
                                           sampling=attempt.sampling, local_prefill=True)
        answered = False
        async for out in decode(ctx, request, attempt.blocks, source=None, prefer=attempt.decode_worker):
            if not answered and not isinstance(out, worker_pb2.PrefillResponse):
                raise AttemptLost("the decode worker sent output before its prefill answer")
            answered = True
            yield out


class RemotePrefill:
    """A prefill worker computes the prompt; its KV moves to the decode worker. With
    ``prefix_from`` (a decode worker's address), the prefill worker first reads the prompt's
    prefix that the decode worker there caches, and computes only the rest. The hold on it
    is released once the prefill call has ended, read or not (the read's notice ended it
    already if it was read); a prefill worker that could not read it computes the whole
    prompt. With streamed KV the prefix is read before the prompt is queued, so the early
    handle and its reads work as without a prefix."""

    label = "remote"

    def __init__(self, stream_kv: bool, prefix_from: str | None = None):
        self.stream_kv = stream_kv
        # The decode worker whose cached prefix the prefill worker reads first (the plan's
        # ``prefix_from``); None: it computes the whole prompt (but what it caches itself).
        self.prefix_from = prefix_from

    async def outputs(self, ctx: CallContext, attempt: Attempt) -> AsyncIterator[Output]:
        salt = ctx.pool.kv_salt(attempt.sampling)  # the adapter's identity folded in, as the workers hash its blocks
        prefix = await hold_prefix(ctx, self.prefix_from, attempt.worker_rid, attempt.prompt,
                                   salt) if self.prefix_from else None
        request = worker_pb2.PrefillRequest(request_id=attempt.worker_rid, prompt_token_ids=attempt.prompt,
                                            sampling=attempt.sampling, router_id=ctx.pool.router_id, prefix=prefix)
        try:
            answer, address, streaming = await prefill(ctx, request, self.stream_kv, salt,
                                                       verify_kv=attempt.verify_kv)
        finally:
            if prefix is not None:
                release_hold_later(ctx, self.prefix_from, prefix.lease_token)
        if ctx.limits.decode_kv_reuse:
            # As for a finished stream's decode worker (RequestRun._expect_cached): the prefill
            # worker caches the prompt now, and the index must not know the decode side's
            # blocks sooner than the prefill side's, or the plan would see a decode worker
            # holding more than every prefill worker until the next poll.
            ctx.pool.index.expect(address, attempt.prompt, salt)
        lease = answer.kv.lease_token if answer.HasField("kv") else ""  # held for us, not yet taken
        decoding = None
        try:
            if streaming is not None:  # the KV streams to a decode worker picked now
                decoding = Started(decode(ctx, _decode_request(attempt, answer), attempt.blocks,
                                          answer.kv.prefill_address, prefer=attempt.decode_worker))
                answer = await streamed_answer(ctx, streaming, address, decoding)
            yield answer
            if answer.finish_reason:
                return
            stream = decoding.stream() if decoding is not None else decode(
                ctx, _decode_request(attempt, answer), attempt.blocks, answer.kv.prefill_address,
                prefer=attempt.decode_worker)
            async for out in stream:
                lease = ""  # the decode worker took it over
                yield out
        finally:
            if decoding is not None:
                await decoding.close()
            if lease:
                release_later(ctx, address, lease)


class MovedKV:
    """The KV of the prompt and every token sent but the last is held by the worker that
    handed the stream over (``kv``); another decode worker reads it and decodes on from
    ``last_token``. If no decode worker takes it, the lease is released (the run re-prefills)."""

    label = "moved"

    def __init__(self, kv: worker_pb2.KVHandle, last_token: int):
        self.kv, self.last_token = kv, last_token

    async def outputs(self, ctx: CallContext, attempt: Attempt) -> AsyncIterator[Output]:
        request = worker_pb2.DecodeRequest(request_id=attempt.worker_rid, prompt_token_ids=attempt.prompt,
                                           first_token_id=self.last_token, sampling=attempt.sampling, kv=self.kv)
        taken = False
        try:
            async for out in decode(ctx, request, attempt.blocks, self.kv.prefill_address):
                taken = True  # the decode worker read the KV (its read's notice ended the lease)
                yield out
        finally:
            if not taken:  # a lease it claimed it ended itself; one nobody claimed ends here
                release_later(ctx, self.kv.prefill_address, self.kv.lease_token)


def _decode_request(attempt: Attempt, answer: worker_pb2.PrefillResponse) -> worker_pb2.DecodeRequest:
    """The decode call after a prefill answer, or with streamed KV after its early handle
    (``kv_streaming``: no first token yet; the decode worker learns it from WatchKV)."""
    return worker_pb2.DecodeRequest(request_id=attempt.worker_rid, prompt_token_ids=attempt.prompt,
                                    first_token_id=answer.first_token_id, sampling=attempt.sampling,
                                    kv=answer.kv, kv_streamed=answer.kv_streaming)


def release_later(ctx: CallContext, address: str, lease_token: str) -> None:
    """Free a lease the decode side never took (best effort; the lease expires anyway)."""
    client = ctx.pool.workers.get(address)
    if client is None:
        return
    # An elastic worker that switched to decode meanwhile still serves the KV it held as prefill,
    # through its prefill service.
    stub = client.stub if client.role == "prefill" else worker_pb2_grpc.PrefillWorkerStub(client.channel)
    release = stub.Release(release_request(lease_token, ReleaseReason.ABORTED), timeout=5)
    detach(ignore_errors(release))
