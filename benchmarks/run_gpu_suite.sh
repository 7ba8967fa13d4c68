#!/usr/bin/env bash
# One call on a GPU machine: environment, the GPU tests, the standard audit, the benchmark.
# Logs go to $OUT (default ./out). Run from the repository root:
#     bash benchmarks/run_gpu_suite.sh
# (PYTHONPATH points at the checkout, so no install is needed; torch is optional.)
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

{
  date -u
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv
  python3 -c "import cupy, numpy; from cupy_backends.cuda.libs import nvrtc; \
print('cupy', cupy.__version__, 'nvrtc', nvrtc.getVersion(), 'numpy', numpy.__version__)"
  python3 -c "import torch; print('torch', torch.__version__, 'cudnn', torch.backends.cudnn.version())" || true
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

echo "== GPU tests"
python3 -m pytest tests/ -q -rs -p no:cacheprovider > "$OUT/tests.log" 2>&1
echo "pytest exit $?"; tail -3 "$OUT/tests.log"

echo "== cuflash-check (standard audit)"
python3 -m cuflash.cli --json "$OUT/audit.json" > "$OUT/audit.txt" 2>&1
echo "cuflash-check exit $?"; tail -2 "$OUT/audit.txt"

echo "== benchmark"
python3 benchmarks/bench.py ${BENCH_ARGS:-} --json "$OUT/bench.json" --markdown "$OUT/bench.md" \
  > "$OUT/bench.txt" 2>&1
echo "bench exit $?"; tail -4 "$OUT/bench.txt"

if [ "${BF16:-1}" = 1 ]; then
  echo "== benchmark, bfloat16, D = 128"
  python3 benchmarks/bench.py --dtype bfloat16 --d 128 --markdown "$OUT/bench_bf16.md" > /dev/null 2>&1
  echo "bench bf16 exit $?"; grep -E "geomean|every point" "$OUT/bench_bf16.md"
fi
