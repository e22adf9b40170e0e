#!/usr/bin/env bash
# The GPU bench (issue 54; docs/gpu.md, "GPU bench"): what pdserve does on one GPU at the size
# users deploy, in phases, each under its own timeout, each writing OUT/PHASE.json as soon as it
# ends (and rewriting it after every measurement), so a run cut short still reports. On the lent
# CUDA host as it is (Python 3.12, a CUDA 13 torch, transformers, no network):
#
#   make gpu-bundle                 # here, with network: gpu_bundle/ (git-ignored)
#   scripts/gpu_bench.sh            # there, with gpu_bundle/ carried along; under 9 minutes
#
# Phases (benchmarks/gpu_bench/, one module each):
#   1. engine_8b    Llama-3.1-8B's shape, dummy weights: load time and peak device memory; the
#                   decode step at batch 1, 8, 64 with 1k and 8k contexts, graphed and eager,
#                   against the memory floor; prefill of 512, 2k, 8k tokens and its MFU
#   2. nixl_vram    NIXL VRAM to VRAM at the 8B block geometry (2 MiB a block): 16, 128, 512
#                   blocks, in order and scattered: GB/s and microseconds a descriptor
#   3. served_smol  router + prefill + decode as plain `pdserve worker` processes on the one GPU
#                   (no Ray), SmolLM2-135M's shape: TTFT, TPOT, ITL p50/p99 and KV transfer
#                   time a request at concurrency 1, 8, 32
#   4. served_8b    the same cluster on the 8B shape (--load-format dummy)
# Then summary.json: the figures BENCHMARKS.md records, from the four files.
#
# OUT (the device tool's output folder; default gpu_bench_out/) gets PHASE.json, PHASE.log and
# each served process's log. PYTHON picks the interpreter. PDSERVE_BENCH_DEVICE=cpu with
# PDSERVE_BENCH_SHAPE=tiny and the PDSERVE_BENCH_* lists cut small dry-runs every phase on the
# CPU (tests/benchmarks/test_gpu_bench.py); PDSERVE_BENCH_PHASES="1 3" runs only those phases.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-gpu_bench_out}
BUNDLE=${GPU_BUNDLE:-gpu_bundle}
PHASES=${PDSERVE_BENCH_PHASES:-1 2 3 4}

# How each served worker takes its share of the one device: `--gpu-memory-utilization F`, the
# share of the device's memory for its weights, a profiled step and its KV cache. Both start at
# once: workers on one device take turns to measure it (pdserve/engine/device_turn.py). 0.45 each: two 8B workers (16 GB of weights
# each) on an 80 GB H100 keep about 20 GB of KV each, and the router has room left.
MEMORY_FLAGS_SMOL=${PDSERVE_BENCH_MEMORY_FLAGS_SMOL:---gpu-memory-utilization 0.2}
MEMORY_FLAGS_8B=${PDSERVE_BENCH_MEMORY_FLAGS_8B:---gpu-memory-utilization 0.45}

# Each phase's limit in seconds: 200 + 70 + 100 + 150 = 520, with the bundle's install under 9
# minutes. A phase stops measuring 15 s before its limit (its --budget-s) and records the rest
# as skipped; the limit itself (SIGTERM, then SIGKILL 20 s later) is for a phase that hangs.
LIMIT_ENGINE=${PDSERVE_BENCH_LIMIT_ENGINE:-200}
LIMIT_NIXL=${PDSERVE_BENCH_LIMIT_NIXL:-70}
LIMIT_SERVED_SMOL=${PDSERVE_BENCH_LIMIT_SERVED_SMOL:-100}
LIMIT_SERVED_8B=${PDSERVE_BENCH_LIMIT_SERVED_8B:-150}

mkdir -p "$OUT"
# shellcheck source=scripts/gpu_site.sh
source scripts/gpu_site.sh
gpu_site "$PY" "$BUNDLE" || echo "== 0. the bundle did not install: the phases run with what the host has"
export PYTHONPATH="$PWD${SITE:+:$SITE}${PYTHONPATH:+:$PYTHONPATH}"
# Importing xgrammar would otherwise compile a torch add-on with nvcc (minutes, on every host).
export TVM_FFI_DISABLE_TORCH_C_DLPACK=1
export PYTHONUNBUFFERED=1

failed=0
# phase INDEX NAME LIMIT_S MODULE [ARGS...]: run one phase under `timeout`, then settle its JSON
# (ok, failed or timeout, with the end of its log) and print its progress line.
phase() {
    local index=$1 name=$2 limit=$3 module=$4 start=$SECONDS rc
    shift 4
    case " $PHASES " in *" $index "*) ;; *) return 0 ;; esac
    echo "== phase $index/4 $name: started $(date -u +%H:%M:%S), limit $limit s"
    timeout -k 20 "$limit" "$PY" -m "benchmarks.gpu_bench.$module" --out "$OUT/$name.json" \
        --budget-s $((limit - 15)) "$@" >"$OUT/$name.log" 2>&1
    rc=$?
    "$PY" -m benchmarks.gpu_bench.outcome "$OUT/$name.json" --rc "$rc" --seconds $((SECONDS - start)) \
        --log "$OUT/$name.log" --index "$index/4" || rc=1
    [ "$rc" = 0 ] || failed=1
}

phase 1 engine_8b "$LIMIT_ENGINE" engine_8b
phase 2 nixl_vram "$LIMIT_NIXL" nixl_vram
phase 3 served_smol "$LIMIT_SERVED_SMOL" served --shape smol --worker-flags "$MEMORY_FLAGS_SMOL"
phase 4 served_8b "$LIMIT_SERVED_8B" served --shape 8b --worker-flags "$MEMORY_FLAGS_8B"

"$PY" -m benchmarks.gpu_bench.report "$OUT" || failed=1
echo "== results in $OUT/ (whole run: $SECONDS s)"
exit "$failed"
