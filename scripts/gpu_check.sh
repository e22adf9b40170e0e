#!/usr/bin/env bash
# The GPU check (issues 26, 43): one command on the lent CUDA host as it is (Python 3.12, a
# CUDA 13 torch 2.11 or later, transformers, no network). No weights ship: the tests build a
# random-weight model of SmolLM2-135M's shape and a byte-level tokenizer on the spot
# (tests/gpu/smol.py).
#
#   make gpu-bundle                 # here, with network: gpu_bundle/ (git-ignored, < 40 MiB)
#   scripts/gpu_check.sh            # there, with gpu_bundle/ carried along
#
# What the host lacks (xgrammar and its closure, protobuf 7, a UCX-only subset of nixl-cu13)
# comes from gpu_bundle/ into a private --target directory put on PYTHONPATH: the host's
# torch, numpy and transformers are never replaced. Without gpu_bundle/ the check uses what is
# installed.
#
# Steps (docs/gpu.md, "GPU check"):
#   1. environment probe: CUDA, driver, flash-attn, triton, NIXL's UCX CUDA libraries, `auto`'s backend
#   2. the engine against transformers on CUDA (float32 exact, bfloat16 logprob-close) on every
#      attention backend present, with chunked prefill, a prefix hit and a preemption
#   3. sampling (seeded, unseeded, top-k/p/min-p, penalties, logprobs) and a JSON-schema request
#   4. NIXL: a two-process VRAM-to-VRAM read of every block, bytes compared, GB/s and UCX transport
#   5. the decode step profile at batch 1 and 64 (ms, syncs, launches, against the HBM floor)
#   6. KV by head between tensor-parallel sizes from VRAM (NIXL through VRAM staging, tcp, checksums)
#   7. TP 2 on the device (two ranks on one GPU over gloo): tokens, KV and a held prefix by head;
#      FP8 matmuls (torch._scaled_mm) against the dequantized path
#   and: CUDA graphs against eager and transformers, the one-sync count, the Triton kernels on the GPU
# Results in $GPU_CHECK_OUT (default gpu_check_out/), at most 8 files: probe.json, junit.xml
# (every test's outcome), pytest.log, nixl.json, step_profile.json. PYTHON picks the
# interpreter (default python3); PDSERVE_CHECK_DEVICE=cpu dry-runs every step on the CPU
# (proving the check, not CUDA), PDSERVE_CHECK_LAYERS shortens the model.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export GPU_CHECK_OUT=${GPU_CHECK_OUT:-gpu_check_out}
BUNDLE=${GPU_BUNDLE:-gpu_bundle}
mkdir -p "$GPU_CHECK_OUT"
# shellcheck source=scripts/gpu_site.sh
source scripts/gpu_site.sh
gpu_site "$PY" "$BUNDLE"
export PYTHONPATH="$PWD${SITE:+:$SITE}${PYTHONPATH:+:$PYTHONPATH}"
# Importing xgrammar would otherwise compile a torch add-on with nvcc (minutes, on every host).
export TVM_FFI_DISABLE_TORCH_C_DLPACK=1
export PYTHONUNBUFFERED=1

echo "== 1. environment probe"
"$PY" scripts/gpu_probe.py

echo "== 2-6. engine, sampling and structured output, NIXL, graphs, syncs, Triton kernels, step profile"
# -p no:cacheprovider: writes nothing into the checkout; -o: pyproject's pytest-timeout and
# --durations options need plugins a bare host may lack.
set +e
TESTS=(tests/gpu/test_engine_on_device.py tests/gpu/test_sampling_on_device.py tests/gpu/test_nixl_vram.py
       $(ls tests/gpu/test_*.py | grep -v -e test_engine_on_device -e test_sampling_on_device \
           -e test_nixl_vram -e test_step_profile -e test_check_here)
       tests/engine/test_one_sync.py tests/engine/test_triton_attention.py tests/engine/test_triton_split_kv.py
       tests/engine/test_triton_fused.py tests/gpu/test_step_profile.py)
# GPU_CHECK_ONLY="tests/a.py tests/b.py::test_x" reruns just those (a short second call on the device).
# shellcheck disable=SC2206
[ -n "${GPU_CHECK_ONLY:-}" ] && TESTS=(${GPU_CHECK_ONLY})
"$PY" -m pytest -q -rA -s -p no:cacheprovider -o addopts="" -o timeout=0 \
    --junitxml "$GPU_CHECK_OUT/junit.xml" "${TESTS[@]}" \
    2>&1 | tee "$GPU_CHECK_OUT/pytest.log"
status=${PIPESTATUS[0]}
set -e
echo "== results in $GPU_CHECK_OUT/"
exit "$status"
