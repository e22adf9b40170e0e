"""The prefill worker: runs prompts through the model and holds their KV for the decode side.

Request lifecycle on this worker:

- READING_PREFIX (only with ``PrefillRequest.prefix``, the reversed pull): before the prompt is
  queued, the part of its prefix that a decode worker holds and this worker's cache lacks is
  read from there into blocks pinned for it (``prefix_pull.py``, ``prefix_source.py``); once
  verified they are final and findable, and the prompt's allocation finds them. A read that
  fails leaves nothing findable, and the prompt is computed whole.
- WAITING: ``Prefill`` queued the prompt in the engine (behind others, under the token budget).
- RUNNING: the prompt is being computed, in one or more chunks, batched with other prompts.
- HELD: the first token is sampled and returned with a KV handle (block ids, the checksum of
  each block, taken once the step that computed it ended, and a secret lease token); the
  engine keeps the sequence HELD, its blocks under a lease (``lease_seconds``). A decode
  worker ``Claim``s the lease (token + exactly its block ids) before reading, which renews
  it, and renews its claim while it reads; a refused claim changes nothing. ``Release(RETURNED)`` hands a claimed lease back
  unread, still HELD, for the router's next decode worker.
- RELEASED: the blocks are freed, because the decode worker's read completed (its
  ``ReadNotice`` names the token), the router or decode worker called ``Release`` (ABORTED,
  TRANSFER_FAILED), the lease expired, or its router died while it was unclaimed
  (OWNER_LOST). A request that finishes at its first token (EOS, max_tokens 1) goes
  straight from RUNNING to RELEASED.

With ``PrefillStream`` (streamed KV), the lease comes while RUNNING: it is granted once the
prompt has blocks and its first chunk has run, the handle goes out at once, and a decode
worker may claim it and read each finished chunk's blocks (``WatchKV`` tells it how far the
prompt is, with the checksums of the blocks each chunk finished) while the next chunks compute. Each chunk renews the lease. Its end while still
RUNNING (the decode side released it, or it expired) stops the prompt. At the last chunk the
request becomes HELD as above, and the decode worker's last read releases it.

A cancelled ``Prefill`` call aborts the request wherever it is; nothing holds blocks without
a lease that will expire. ``Abort`` by request id stops a prompt still computing but never
frees HELD KV: that takes the token (clients choose request ids). ``pdserve.kv_transfer.handoff``
owns the handle and the lease rules, and the words (release, free, abort, cancel, forget).

The worker keeps one ``RequestRecord`` per request (``record.py``), made when ``Prefill``
arrives and removed by ``PrefillWorker.forget``, which every end above calls: it ends the
lease if it is still held, frees the blocks wherever the request is, and tells ``WatchKV``
callers. A request without a record holds no block.
"""
