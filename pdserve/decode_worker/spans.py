"""One ``Decode`` call's spans on a decode worker while tracing is on (``pdserve.wire.tracing``),
recorded from times the call sees go by, never from the engine thread:

    decode_worker.Decode          the call (under the router's span, from its metadata)
    ├── kv_transfer               the reads of the prompt's KV: bytes, blocks, backend, source
    ├── decode.queue              KV in, until the first token out (the wait to join the batch)
    │   (decode.prefill_local     instead, when this worker prefills the prompt itself)
    └── decode                    the first token out to the last
"""

from __future__ import annotations

import time

from pdserve.decode_worker.worker import KVArrived
from pdserve.wire import tracing


class DecodeSpans:
    def __init__(self, context, request, worker_id: str, backend: str):
        self.span = tracing.server_span(context, "decode_worker.Decode", {
            tracing.REQUEST_ID: request.request_id, tracing.WORKER_ID: worker_id,
            tracing.PROMPT_TOKENS: len(request.prompt_token_ids)})
        self.backend = backend
        self.source = request.kv.prefill_address
        self.local = request.local_prefill
        self.since = time.monotonic()  # the start of what the next output ends
        self.first_at: float | None = None
        self.tokens = 0

    def kv_arrived(self, kv: KVArrived) -> None:
        tracing.record_span("kv_transfer", self.span, kv.started_at, kv.finished_at, {
            tracing.KV_BYTES: kv.nbytes, tracing.KV_BLOCKS: kv.blocks, tracing.KV_BACKEND: self.backend,
            tracing.KV_SOURCE: self.source, tracing.KV_TRANSFER_TIME: kv.finished_at - kv.started_at,
            "pdserve.kv_transfer.reused_blocks": kv.reused_blocks})  # found here: not read
        self.since = time.monotonic()

    def output(self, new_tokens: int) -> None:
        if self.first_at is None:
            self.first_at = time.monotonic()
            tracing.record_span("decode.prefill_local" if self.local else "decode.queue", self.span, self.since,
                                self.first_at)
        self.tokens += new_tokens

    def end(self, error: BaseException | None = None) -> None:
        """The call ended: with ``error``, or cancelled (GeneratorExit, CancelledError), or done (None)."""
        if error is not None and not isinstance(error, Exception):
            error = "cancelled"  # the router closed the stream
        if self.first_at is not None:
            tracing.record_span("decode", self.span, self.first_at, time.monotonic(),
                                {tracing.COMPLETION_TOKENS: self.tokens})
        tracing.end_span(self.span, error=error, attributes={tracing.COMPLETION_TOKENS: self.tokens})
