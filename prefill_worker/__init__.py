"""The prefill worker: runs prompts through the model and holds their KV for the decode side.

Request lifecycle on this worker:

- WAITING: ``Prefill`` queued the prompt in the engine (behind others, under the token budget).
- RUNNING: the prompt is being computed, in one or more chunks, batched with other prompts.
- HELD: the first token is sampled and returned with a KV handle (block ids + lease id);
  the blocks stay allocated under a lease (default 30 s).
- RELEASED: the blocks are freed, because the decode worker's NIXL read completed (its
  notification names the lease), the router or decode worker called ``Release`` (abort or a
  failed transfer), or the lease expired. A request that finishes at its first token (EOS,
  max_tokens 1) goes straight from RUNNING to RELEASED.

A cancelled ``Prefill`` call aborts the request wherever it is; nothing holds blocks without
a lease that will expire.
"""
