"""pdserve: disaggregated prefill/decode LLM serving.

One import name for the whole project; each subpackage owns one layer (docs/architecture.md):
``pdserve.engine`` (model, KV cache, scheduler), ``pdserve.protos`` (wire types),
``pdserve.wire`` (gRPC plumbing), ``pdserve.kv_transfer`` (moving KV between workers),
``pdserve.shell`` (the worker shell), ``pdserve.prefill_worker`` and ``pdserve.decode_worker``
(the two worker roles), ``pdserve.router`` (public APIs and routing), ``pdserve.cluster``
(placement, supervision, autoscaling, the cluster's commands), ``pdserve.planner`` (capacity
planning), and ``pdserve.cli``, the ``pdserve`` command over them all.
"""
