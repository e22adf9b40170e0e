"""pdserve: disaggregated prefill/decode LLM serving.

One import name for the whole project; each subpackage owns one layer (docs/architecture.md):
``pdserve.engine`` (model, KV cache, scheduler), ``pdserve.kv_transfer`` (moving KV between
workers), ``pdserve.prefill_worker`` and ``pdserve.decode_worker`` (the two worker roles),
``pdserve.router`` (public APIs and routing), ``pdserve.wire`` (gRPC plumbing and the worker
shell), ``pdserve.cluster`` (placement, supervision, autoscaling, the ``pdserve`` CLI),
``pdserve.planner`` (capacity planning) and ``pdserve.protos`` (wire types).
"""
