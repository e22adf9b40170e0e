"""The elastic worker: one process, one engine, one KV cache and one KV agent, serving both the
``PrefillWorker`` and the ``DecodeWorker`` gRPC services, and a role that says which of the two
takes new requests. Its role changes in place, without a model load (``SetRole``).

The two roles are the prefill and decode workers' own cores (``PrefillWorker``, ``DecodeWorker``)
over the shared engine, stepped by one engine thread (``pdserve.shell.worker.run_together``):
every request keeps the lifecycle its role's package describes. The role not held is *closed*:
it refuses new requests as a draining worker does (prefill: UNAVAILABLE, decode:
RESOURCE_EXHAUSTED; the router tries another worker), and its Stats say draining.

A switch (``ElasticWorker.set_role``), one at a time:

1. CLOSING: the old role closes at once; the controller has already taken the worker out of the
   router's old pool (``pdserve.cluster.local.LocalCluster.set_role``), so nothing new should
   arrive, and what does is refused.
2. DRAINING: what the old role runs finishes, up to ``grace_s``: a prefill role's prompts are
   answered and the KV it holds is pulled (or its lease ends); a decode role's streams finish.
   Past the grace, decode streams still running are handed over (their calls end UNAVAILABLE
   and the router migrates them); held KV stays served, since ``Claim``, ``WatchKV`` and
   ``Release`` are never closed, until it is pulled or its lease expires.
3. OPEN: the new role takes requests; the controller adds the worker to the router's new pool.

A third role, ``mixed``, uses the decode core: the worker takes streams and the router lets it
prefill the ones it takes itself (``pdserve.elastic_worker.roles``). Switching between decode and
mixed closes nothing and drains nothing; only the router's use of the worker changes.
"""
