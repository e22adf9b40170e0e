#!/usr/bin/env bash
# A lent GPU session's one call (docs/gpu.md, "A GPU session"): the whole GPU check, then the
# whole bench, each under its own limit, and everything both write tarred into OUT/all.tgz (the
# device tool brings back at most 8 files). With gpu_bundle/ carried (`make gpu-bundle` here):
#
#   OUT=$OUT scripts/gpu_session.sh     # about 6 minutes on an H200: ask the tool for 600 s
#
# The check's default list covers every test under tests/gpu/ (TP 2 on the device, KV by head,
# FP8) and the Triton kernels (split-KV, fused); the bench's 8B decode worker writes its step
# trace (what the step budget made of mixed steps). LIMIT_CHECK and LIMIT_BENCH (seconds) cap each
# part; the bench's own phase limits (scripts/gpu_bench.sh) sum to more, and a phase past the
# bench's limit is recorded as timed out by the report that follows. The bundle is installed once,
# into one site both parts use.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_session_out}
WORK=$(mktemp -d /tmp/pdserve-gpu-session.XXXXXX)
export GPU_CHECK_SITE=${GPU_CHECK_SITE:-$WORK/site}
mkdir -p "$OUT" "$WORK/check" "$WORK/bench"
start=$SECONDS

echo "== the GPU check (limit ${LIMIT_CHECK:-290} s)"
GPU_CHECK_OUT="$WORK/check" timeout -k 10 "${LIMIT_CHECK:-290}" scripts/gpu_check.sh >"$WORK/check.out" 2>&1
echo "check: exit $? after $((SECONDS - start)) s" | tee -a "$WORK/status"
grep -E "^(PASSED|FAILED|ERROR)|passed|failed" "$WORK/check.out" | tail -25

echo "== the GPU bench (limit ${LIMIT_BENCH:-270} s)"
export PDSERVE_BENCH_MEMORY_FLAGS_8B=${PDSERVE_BENCH_MEMORY_FLAGS_8B:---gpu-memory-utilization 0.45 --step-trace-dir $WORK/bench/trace_8b}
bench_start=$SECONDS
OUT="$WORK/bench" timeout -k 10 "${LIMIT_BENCH:-270}" scripts/gpu_bench.sh >"$WORK/bench.out" 2>&1
rc=$?
[ -f "$WORK/bench/summary.json" ] || "${PYTHON:-python3}" -m benchmarks.gpu_bench.report "$WORK/bench" >>"$WORK/bench.out" 2>&1
echo "bench: exit $rc after $((SECONDS - bench_start)) s" | tee -a "$WORK/status"
tail -30 "$WORK/bench.out"

tar czf "$OUT/all.tgz" -C "$WORK" --exclude site .
echo "== everything in $OUT/all.tgz ($((SECONDS - start)) s in all)"
