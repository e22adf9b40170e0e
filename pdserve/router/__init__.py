"""The router: the public gRPC API, validation, routing, and the life of a request.

Request lifecycle at the router:

- RECEIVED: validated and tokenized (text, token ids or chat messages with the template).
- PREFILLING: a prefill worker, chosen by the routing policy, computes the prompt and
  samples the first token, which streams to the client at once. A prefill worker that is
  unreachable or fails is retried on another.
- DECODING: a decode worker pulls the KV over NIXL and streams the rest. If the transfer
  fails or the decode worker dies, the router re-prefills prompt + tokens already sent on a
  healthy pair and continues the same stream: no token repeated or lost.
- FINISHED (stop, length), ABORTED (Abort, cancelled stream) or FAILED (no worker could
  serve it: UNAVAILABLE / RESOURCE_EXHAUSTED with the reason).

Stop strings are applied here, the one place that sees the whole text; the decode worker
is cancelled when one matches.

Where each part lives: ``frontend`` validates and tokenizes (once per request, into one
engine ``SamplingParams``); ``request_run`` is a request's life (attempts, migration, the
deadline and admission budget of ``request_budget``); ``attempts`` holds the two attempt
kinds (prefill on a prefill worker, or locally on the decode worker), which make the
``prefill_call`` and the ``decode_call``; ``worker_calls`` reads what a worker's error means
(``triage``, once for every call); ``output_processor`` turns worker outputs into the
client's responses (text, stop strings, logprobs, usage).
"""
