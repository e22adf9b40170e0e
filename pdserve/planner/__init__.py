"""Capacity planning for pdserve: cost models, a discrete-event cluster simulator, a pool-size
search and trace replay.

Modules:
- ``hardware``: named hardware profiles (GPU datasheet peaks with efficiency factors; the CPU
  profile that ``pdserve profile`` fits from our own engine).
- ``model_spec``: what the cost model needs of a model (parameters, FLOPs, and KV bytes per
  token as the engine's cache lays them out), from an engine ``ModelConfig``: a config.json's,
  or a family's published checkpoint by name.
- ``tp``: the tensor-parallel sizes the engine's layers accept.
- ``cost``: step times (prefill, decode) and KV transfer times, pure functions of the above.
- ``trace``: the request trace format (JSONL) and synthetic workloads.
- ``worker``: one simulated worker, applying the engine scheduler's rules step by step;
  ``prefix_cache`` its prefix cache and the KV tier below it, one per host.
- ``simulator``: the event loop over a cluster of workers, the real routing policy and the
  real autoscaling policies; ``metrics`` turns its records into TTFT/TPOT/ITL and goodput.
- ``search``: ``pdserve plan``'s search for the fewest GPUs that meet a rate at an SLO.
- ``profile``: ``pdserve profile``, measuring the engine on this machine.
"""
