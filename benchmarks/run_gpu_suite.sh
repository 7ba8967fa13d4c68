#!/usr/bin/env bash
# One call on a GPU machine: environment, the GPU tests, the standard audit, the benchmark, and
# the quick benchmarks of the backward, the decode path and the host launch time.
# Logs go to $OUT (default ./out). Run from the repository root:
#     bash benchmarks/run_gpu_suite.sh
# Parts can be skipped (each run of a GPU machine may be limited to minutes): PRECOMPILE=0, TESTS=0,
# AUDIT=0 (AUDIT=parallel: one audit process per dtype beside the tests), BENCH=0, EXTRA=0;
# PYTEST_ARGS narrows the tests (e.g. "tests/test_backward_gpu.py") and runs them in one process,
# else every GPU test runs in SHARDS (default 12) interleaved shards side by side; TEST_TIMEOUT
# (seconds) bounds them, or DEADLINE (seconds from the start: the tests get what is left, so a call
# of a 10-minute machine can keep time to pack its logs); TEST_PATHS (default "tests"; e.g.
# "@nodes.txt", a file of node ids) picks what the shards run; FLAGS adds pytest arguments
# (--cuflash-flag ...); PRECOMPILE_LIMIT (seconds, default 300) bounds the precompile.
# The H200 machine reported nproc = 2 on 2026-12-02 (session i): precompile then takes ~5 min and
# the shards are CPU-bound; size SHARDS and the limits to `nproc`, not to the machine's name.
# (PYTHONPATH points at the checkout, so no install is needed; torch is optional.)
# CACHE_TAR: a .tar.xz of a kernel cache made on another machine with the device's NVRTC
# (benchmarks/pack_cache.sh), unpacked before the precompile, which then only checks it (all 1249
# specialisations in 0.1 s on the H200 machine of session t, whose nproc was 2: there a precompile
# takes ~8 minutes). ARCHIVE=1: every log also in one $OUT/logs.tgz (the device tool returns a
# limited number of files; session t lost its failure logs to that limit).
set -uo pipefail
T0=$(date +%s)
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# The shards run side by side and their float64 references are BLAS-bound: without a thread limit
# each process takes every core (on the H200 machine, 16 shards' worth of workers cut most shards
# at their timeout, 2026-12-01).
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} OPENBLAS_NUM_THREADS=${OPENBLAS_NUM_THREADS:-2}

{
  date -u; echo "nproc $(nproc)"
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv
  python3 -c "import cupy, numpy; from cupy_backends.cuda.libs import nvrtc; \
print('cupy', cupy.__version__, 'nvrtc', nvrtc.getVersion(), 'numpy', numpy.__version__)"
  python3 -c "import torch; print('torch', torch.__version__, 'cudnn', torch.backends.cudnn.version())" || true
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

if [ "${PRECOMPILE:-1}" = 1 ]; then
  # Every specialisation compiled once, in parallel, into the disk cache the shards then read
  # (~970 specialisations in ~80 s on the H200 machine's 16 cores, 2026-12-02), instead of each
  # shard compiling its own at first use.
  echo "== precompile"
  export CUFLASH_CACHE_DIR=${CUFLASH_CACHE_DIR:-$PWD/.devcache}
  if [ -n "${CACHE_TAR:-}" ] && [ -f "$CACHE_TAR" ]; then
    mkdir -p "$CUFLASH_CACHE_DIR"
    tar xJf "$CACHE_TAR" -C "$CUFLASH_CACHE_DIR" --strip-components=1
    echo "cache from $CACHE_TAR: $(ls "$CUFLASH_CACHE_DIR" | wc -l) files"
  fi
  timeout "${PRECOMPILE_LIMIT:-300}" python3 -m cuflash.precompile --jobs "$(nproc)" \
    > "$OUT/precompile.txt" 2>&1
  echo "precompile exit $?: $(tail -1 "$OUT/precompile.txt")"
fi

# AUDIT=parallel: the standard audit as one process per dtype, side by side with the test shards
# (on the H200 machine the float32 part alone took 307 s and the others 115-148 s, 2026-12-02,
# so in series after the tests they do not fit one 10-minute call); keep SHARDS + 4 processes
# within the machine's cores (SHARDS=10 on 16).
audit_pids=()
if [ "${AUDIT:-1}" = parallel ]; then
  echo "== cuflash-check, one process per dtype (beside the tests)"
  for dt in float16 bfloat16 float32 float64; do
    timeout -s INT "${AUDIT_TIMEOUT:-3000}" python3 -m cuflash.cli --dtype "$dt" \
      --json "$OUT/audit_$dt.json" > "$OUT/audit_$dt.txt" 2>&1 &
    audit_pids+=($!)
  done
fi

if [ "${TESTS:-1}" = 1 ]; then
  echo "== GPU tests"
  if [ -n "${PYTEST_ARGS:-}" ]; then
    timeout -s INT "${TEST_TIMEOUT:-3000}" python3 -m pytest $PYTEST_ARGS ${FLAGS:-} -q -rfEs \
      -p no:cacheprovider > "$OUT/tests.log" 2>&1
    echo "pytest exit $?"; tail -3 "$OUT/tests.log"
  else
    # Every GPU test (-m gpu, all files) in SHARDS interleaved shards side by side (tests/
    # conftest.py's --shard: the i-th test goes to shard i % SHARDS + 1), so the shards are of
    # one size and a shard cut by TEST_TIMEOUT loses a spread of cases, not the same files'
    # tails on every run (file-by-file shards never reached the end of test_inference_gpu.py,
    # 2026-12-02). SIGINT at the timeout, so pytest still prints its summary of what ran.
    # FLAGS adds pytest arguments to every shard, e.g. FLAGS="--cuflash-flag
    # _decode.DECODE_VERSION=2" runs the suite with a flag on before it is switched on.
    n=${SHARDS:-12}
    limit=${TEST_TIMEOUT:-3000}
    if [ -n "${DEADLINE:-}" ]; then limit=$(( DEADLINE - ($(date +%s) - T0) )); fi
    shard_pids=()
    for k in $(seq 1 "$n"); do
      ( timeout -s INT "$limit" python3 -m pytest ${TEST_PATHS:-tests} -m gpu \
          --ignore=tests/test_compile.py --shard "$k/$n" ${FLAGS:-} -v -rfEs -p no:cacheprovider \
          --durations=5 > "$OUT/tests_$k.log" 2>&1
        echo "shard $k/$n exit $?: $(tail -1 "$OUT/tests_$k.log")" ) &
      shard_pids+=($!)
    done
    wait "${shard_pids[@]}"
    grep -h -E "^(FAILED|ERROR)" "$OUT"/tests_*.log | head -50
    # The totals over the shards (a cut shard's own line says "interrupted").
    cat "$OUT"/tests_*.log | grep -E -c " PASSED" | sed 's/^/passed (all shards): /'
    cat "$OUT"/tests_*.log | grep -E -c " (FAILED|ERROR)" | sed 's/^/failed or errors (all shards): /'
  fi
fi

if [ ${#audit_pids[@]} -gt 0 ]; then
  for i in "${!audit_pids[@]}"; do wait "${audit_pids[$i]}"; echo "cuflash-check part $i exit $?"; done
  for dt in float16 bfloat16 float32 float64; do echo "$dt: $(tail -1 "$OUT/audit_$dt.txt")"; done
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

if [ "${ARCHIVE:-0}" = 1 ]; then
  ( cd "$OUT" && tar czf logs.tgz --exclude=logs.tgz . ) && echo "logs in $OUT/logs.tgz"
fi
