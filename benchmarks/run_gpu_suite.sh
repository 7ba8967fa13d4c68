#!/usr/bin/env bash
# One call on a GPU machine: environment, the GPU tests, the standard audit, the benchmark, and
# the quick benchmarks of the backward, the decode path and the host launch time.
# Logs go to $OUT (default ./out). Run from the repository root:
#     bash benchmarks/run_gpu_suite.sh
# Parts can be skipped (each run of a GPU machine may be limited to minutes): TESTS=0, AUDIT=0,
# BENCH=0, EXTRA=0; PYTEST_ARGS narrows the tests (e.g. "tests/test_backward_gpu.py") and runs them in
# one process, else the GPU test files run in six parallel shards; TEST_TIMEOUT (seconds) bounds them.
# (PYTHONPATH points at the checkout, so no install is needed; torch is optional.)
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# The shards run side by side and their float64 references are BLAS-bound: without a thread limit
# each process takes every core (on the H200 machine, 16 shards' worth of workers cut most shards
# at their timeout, 2026-12-01).
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} OPENBLAS_NUM_THREADS=${OPENBLAS_NUM_THREADS:-2}

{
  date -u
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv
  python3 -c "import cupy, numpy; from cupy_backends.cuda.libs import nvrtc; \
print('cupy', cupy.__version__, 'nvrtc', nvrtc.getVersion(), 'numpy', numpy.__version__)"
  python3 -c "import torch; print('torch', torch.__version__, 'cudnn', torch.backends.cudnn.version())" || true
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

if [ "${TESTS:-1}" = 1 ]; then
  echo "== GPU tests"
  if [ -n "${PYTEST_ARGS:-}" ]; then
    timeout -s INT "${TEST_TIMEOUT:-3000}" python3 -m pytest $PYTEST_ARGS -q -rfEs \
      -p no:cacheprovider > "$OUT/tests.log" 2>&1
    echo "pytest exit $?"; tail -3 "$OUT/tests.log"
  else
    # The GPU test files in parallel shards (first-use compiles are CPU-bound; on the H200 the
    # files took 2-8 minutes each in one process); SIGINT at the timeout, so pytest still prints
    # its summary of what ran.
    shard() { local name=$1; shift
      timeout -s INT "${TEST_TIMEOUT:-3000}" python3 -m pytest "$@" -v -rfEs -p no:cacheprovider \
        --durations=10 > "$OUT/tests_$name.log" 2>&1
      echo "shard $name exit $?: $(tail -1 "$OUT/tests_$name.log")"; }
    shard fwd tests/test_gpu.py &
    shard bwd tests/test_backward_gpu.py tests/test_varlen_backward_gpu.py &
    shard nonfinite tests/test_nonfinite.py tests/test_gpu_float32.py &
    shard inference tests/test_inference_gpu.py tests/test_workspace_gpu.py &
    shard variants_ring tests/test_variants_gpu.py tests/test_ring_gpu.py tests/test_callcache.py tests/test_callcache_gpu.py &
    shard misc tests/test_jax.py tests/test_issue16_defects.py tests/test_bound.py \
      tests/test_report.py tests/test_examples.py tests/test_mods_gpu.py tests/test_jax_cmdbuf.py &
    wait
    grep -h -E "^(FAILED|ERROR)" "$OUT"/tests_*.log | head -50
  fi
fi

if [ "${AUDIT:-1}" = 1 ]; then
  echo "== cuflash-check (standard audit)"
  timeout -s INT "${AUDIT_TIMEOUT:-3000}" python3 -m cuflash.cli --json "$OUT/audit.json" \
    > "$OUT/audit.txt" 2>&1
  echo "cuflash-check exit $?"; tail -2 "$OUT/audit.txt"
fi

if [ "${BENCH:-1}" = 1 ]; then
  echo "== benchmark"
  python3 benchmarks/bench.py ${BENCH_ARGS:-} --json "$OUT/bench.json" --markdown "$OUT/bench.md" \
    > "$OUT/bench.txt" 2>&1
  echo "bench exit $?"; tail -4 "$OUT/bench.txt"
fi

if [ "${EXTRA:-1}" = 1 ]; then
  echo "== backward, decode, host time (quick)"
  python3 benchmarks/bench.py --pass backward --quick \
    --impl cuflash,cuflash-det,torch-flash,torch-cudnn --markdown "$OUT/bwd.md" > "$OUT/bwd.txt" 2>&1
  echo "bench backward exit $?"; tail -4 "$OUT/bwd.txt"
  python3 benchmarks/bench_inference.py --quick > "$OUT/inference.txt" 2>&1
  echo "bench_inference exit $?"; tail -4 "$OUT/inference.txt"
  python3 benchmarks/host_time.py > "$OUT/host_time.txt" 2>&1
  echo "host_time exit $?"; tail -24 "$OUT/host_time.txt"
fi

if [ "${BENCH:-1}" = 1 ] && [ "${BF16:-1}" = 1 ]; then
  echo "== benchmark, bfloat16, D = 128"
  python3 benchmarks/bench.py --dtype bfloat16 --d 128 --markdown "$OUT/bench_bf16.md" > /dev/null 2>&1
  echo "bench bf16 exit $?"; grep -E "geomean|every point" "$OUT/bench_bf16.md"
fi
