#!/usr/bin/env bash
# The GPU check (issue 26): one command on a bare CUDA host that has Python and a CUDA torch,
# without network access. No weights ship: the tests build a random-weight model of
# SmolLM2-135M's shape and a byte-level tokenizer on the spot (tests/gpu/smol.py).
#
#   WHEELHOUSE=wheelhouse scripts/gpu_check.sh     # first installs what it needs from there
#   scripts/gpu_check.sh                           # when those packages are installed already
#
# Steps (docs/gpu.md, "GPU check"):
#   1. environment probe: CUDA, driver, flash-attn, NIXL's UCX CUDA libraries, `auto`'s backend
#   2. the engine against transformers on CUDA: float32 exact, bfloat16 logprob-close, on every
#      attention backend present, with chunked prefill, a prefix hit and a preemption
#   3. sampling (seeded, unseeded, top-k/p/min-p, penalties, logprobs) and a JSON-schema request
#   4. a decode step profile at batch 1 and 64 (ms, host syncs and kernel launches a step; batch 1
#      against its memory floor: weight bytes over the device read bandwidth), and a 512-token prefill
#   5. KV by head between tensor-parallel sizes from VRAM (NIXL row descriptors, tcp, checksums)
# Results go to $GPU_CHECK_OUT (default gpu_check_out/): probe.json, step_profile.json,
# pytest.log. PYTHON picks the interpreter (default python3); PDSERVE_CHECK_DEVICE=cpu
# dry-runs every step on the CPU (proving the check, not CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export GPU_CHECK_OUT=${GPU_CHECK_OUT:-gpu_check_out}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$GPU_CHECK_OUT"

if [ -n "${WHEELHOUSE:-}" ]; then
    # --no-deps: the wheelhouse holds the whole closure; pip must not reach for an index or
    # touch the host's torch.
    "$PY" -m pip install --quiet --no-index --no-deps --find-links "$WHEELHOUSE" -r scripts/gpu_check_requirements.txt
fi

echo "== 1. environment probe"
"$PY" scripts/gpu_probe.py

echo "== 2-5. engine, sampling and structured output, step profile, KV by head (tests/gpu, marker cuda)"
# -p no:cacheprovider: writes nothing into the checkout; -o: pyproject's pytest-timeout and
# --durations options need plugins a bare host may lack.
set +e
"$PY" -m pytest -m cuda -q -rs -s -p no:cacheprovider -o addopts="" -o timeout=0 \
    tests/gpu/test_engine_on_device.py tests/gpu/test_sampling_on_device.py tests/gpu/test_step_profile.py \
    tests/gpu/test_kv_by_head_on_device.py \
    2>&1 | tee "$GPU_CHECK_OUT/pytest.log"
status=${PIPESTATUS[0]}
set -e
echo "== results in $GPU_CHECK_OUT/"
exit "$status"
