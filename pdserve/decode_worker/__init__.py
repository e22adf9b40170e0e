"""The decode worker: pulls a prompt's KV from a prefill worker (or prefills it itself), then
generates the rest.

Request lifecycle on this worker:

- WAITING_FOR_KV: ``Decode`` arrived; blocks are allocated for the prompt (no prompt
  forward pass ever runs here; a full cache answers RESOURCE_EXHAUSTED before the lease is
  claimed, so the router's next decode worker finds it held), the prefill worker's metadata
  is known (fetched once per peer over gRPC and cached), and the lease is claimed. With
  ``decode_kv_reuse`` the leading blocks this worker's prefix cache holds for the prompt (same
  cache salt: a conversation's earlier turns, prompt and answer) are taken as they are.
- TRANSFERRING: a NIXL READ moves the prompt's KV from the prefill worker's blocks straight
  into ours (the blocks past those reused: always at least the last one); on completion NIXL
  notifies the prefill worker, which frees its copy. Each block that lands is checked against
  the checksum the prefill worker sent with the lease (a mismatch fails the transfer), and
  only then is the engine told the KV is ready. While its reads run, the worker renews its
  claim on the lease, so the holder never frees the blocks under it.
  Streamed KV (``kv_streamed``): the lease comes while the prompt still computes; the worker
  reads each stretch of finished blocks as ``WatchKV`` reports it, then the rest and the
  first token once the prompt is done; that last read, whose notice ends the lease, starts
  only once every earlier read is done. Any failed read fails the transfer as a whole.
- RUNNING: the request joins the continuous batch, decoding from the first token the
  prefill worker sampled; every step's token streams back to the router.
- FINISHED: EOS, a stop token, max_tokens or the context length; blocks freed, their KV kept
  findable in the prefix cache (LRU) and, with ``decode_kv_reuse``, published to routers in
  ``Stats`` (``pdserve.shell.cache_events``) for the conversation's next turn.
- LOCAL PREFILL (instead of the two states above, when ``Decode`` asks for
  ``local_prefill``: colocated mode, or the router's conditional-disaggregation rule): the
  prompt queues in this worker's engine and its chunks run in the same steps as the running
  streams (the ``mixed`` scheduling policy); the stream's first response is the prefill
  answer (``prefilled``: the first token, as a prefill worker would have answered), then the
  request is RUNNING like any other.
- ABORTED: the router cancelled the stream (client gone, stop string, Abort) or the
  transfer failed. A failed transfer (or a refused claim) is reported to the router with the
  typed failure code ``kv_transfer`` (it re-runs the prefill elsewhere) and to the prefill
  worker through ``Release``, never silently recomputed. A step that raises aborts its
  requests with the code ``step_failed``. Blocks a stopped read may still write stay
  QUARANTINED until the transport says that read is over (``pdserve.shell.read_quarantine``).

Besides its requests, the worker may hold cached prefixes for prefill workers to read (the
reversed pull, ``prefix_hold.py``): ``HoldPrefix`` pins them under a lease, which the reader's
read notice, a ``Release`` or expiry ends; the streams decoding here are not touched.
"""
