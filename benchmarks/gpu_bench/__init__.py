"""The GPU bench (scripts/gpu_bench.sh, docs/gpu.md "GPU bench"): one module a phase, each run
as ``python -m benchmarks.gpu_bench.<phase> --out FILE.json``, each rewriting its JSON after
every measurement so that a phase cut by its timeout still reports what it measured.

- ``engine_8b``: Llama-3.1-8B's shape with dummy weights: load time and peak device memory,
  the decode step (eager and CUDA-graphed) against its memory floor, prefill and its MFU.
- ``nixl_vram``: NIXL reads VRAM to VRAM at the 8B shape's block geometry.
- ``served``: router, prefill and decode as plain ``pdserve worker`` processes on one device,
  under a closed-loop load (TTFT, TPOT, ITL, KV transfer time per request).
- ``outcome``: what the script runs after each phase: marks the JSON ok, failed or timed out.

``common`` holds the shapes, the settings read from ``PDSERVE_BENCH_*`` variables (the CPU dry
run cuts every shape with them), the device's spec sheet and the JSON record.
"""
