"""ncu target: the float32 "highest" Hopper forward (3xfp16) at one point of the standard grid,
with K and V split once per call (_dispatch.HOPPER_F32_PRESPLIT) and per tile (the in-place
split), without and with the causal mask. Three warm-up rounds, then one call of each inside
cudaProfilerStart/Stop; afterwards each form's causal output of one (batch, head) slice is checked
against the float64 reference with the project's pass rule. From the repository root, on the GPU
machine (issue 10: the D = 256, S = 512 causal point, notes/FLOAT32.md):

    PYTHONPATH=. ncu --profile-from-start off --clock-control none --set full \
        --import-source no -o OUT/f32 python3 benchmarks/ncu_f32.py --d 256 --s 512
    ncu -i OUT/f32.ncu-rep --page details > OUT/f32_details.txt

B * S = 16384 and H * D = 2048, as in benchmarks/bench.py's grid.
"""
import argparse

import numpy as np

import cupy as cp

import cuflash
from cuflash import _dispatch, reference

ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
ap.add_argument("--d", type=int, default=256)
ap.add_argument("--s", type=int, default=512)
ap.add_argument("--forms", default="presplit,inplace", help="presplit and/or inplace")
ap.add_argument("--causal", default="0,1")
args = ap.parse_args()
D, S = args.d, args.s
B, H = 16384 // S, 2048 // D
forms = args.forms.split(",")
causals = [bool(int(c)) for c in args.causal.split(",")]
rng = np.random.default_rng(0)
q, k, v = (cp.asarray(rng.standard_normal((B, H, S, D), dtype=np.float32)) for _ in range(3))
outs = {(f, c): cp.full_like(q, cp.nan) for f in forms for c in causals}


def run_all():
    for form in forms:
        _dispatch.HOPPER_F32_PRESPLIT = form == "presplit"
        for causal in causals:
            cuflash.attention(q, k, v, causal=causal, out=outs[form, causal])


for _ in range(3):
    run_all()
cp.cuda.Device().synchronize()
for form in forms:
    _dispatch.HOPPER_F32_PRESPLIT = form == "presplit"
    for causal in causals:
        print(form, "causal" if causal else "full",
              cuflash.dispatch_info(q, k, v, causal=causal))
cp.cuda.profiler.start()
run_all()
cp.cuda.Device().synchronize()
cp.cuda.profiler.stop()

q64, k64, v64 = (cp.asnumpy(x[0, 0]).astype(np.float64) for x in (q, k, v))
for (form, causal), out in outs.items():
    o_ref, _ = reference.attention_ref(q64, k64, v64, causal=causal)
    rule = reference.pass_threshold(q64, k64, v64, causal=causal, dtype="float32", o_ref=o_ref)
    verdict = rule.judge(cp.asnumpy(out[0, 0]).astype(np.float64))
    if not verdict.passed or not bool(cp.isfinite(out).all()):
        raise SystemExit(f"{form} causal={causal}: output wrong: " + "; ".join(verdict.reasons))
    print(f"{form} causal={causal} checked: max abs error {verdict.max_abs_err:.2e} <= "
          f"{rule.threshold:.2e}")
