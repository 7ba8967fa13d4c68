"""The truncating-accumulator model (tests/kernel_model.py, accumulate="truncate") against the H200
measurement of benchmarks/fp32_tc_probe.py (2026-12-01, the old arithmetic), on the probe's own
inputs: per variant the max over the seeds of max abs err / naive float32 error, of
err / threshold, and how many seeds fail the project rule. CPU only; from the repository root:
PYTHONPATH=. python benchmarks/fp32_tc_model.py rn,trunc,trunc_x3,prom,prom_x3 [seeds [first]]
(notes/FLOAT32.md). prom: attn_mma.cu's arithmetic on sm_90; prom_s: on sm_80."""
import sys

import numpy as np

sys.path.insert(0, "tests")
from cuflash import _dispatch  # noqa: E402
from cuflash import reference as ref  # noqa: E402
from kernel_model import tensorcore_model  # noqa: E402

MEASURED = {(64, 1, 64): 3.46, (64, 1, 113): 2.63, (64, 16, 113): 1.99, (64, 1, 128): 5.37,
            (64, 64, 200): 1.27, (64, 1, 1000): 2.23, (64, 113, 113): 2.44,
            (128, 1, 64): 4.12, (128, 1, 113): 3.76, (128, 16, 113): 2.13, (128, 1, 128): 5.80,
            (128, 64, 200): 1.18, (128, 1, 1000): 2.91, (128, 113, 113): 1.77}
MFAIL = {(64, 1, 128): 1, (128, 1, 128): 3}
VARIANTS = dict(
    rn=dict(),
    trunc=dict(accumulate="truncate"),
    trunc_x3=dict(accumulate="truncate", extra_bits=3),
    prom_x3=dict(accumulate="truncate", promote_s=1, promote_pv=1, extra_bits=3),
    prom2_x3=dict(accumulate="truncate", promote_s=2, promote_pv=2, extra_bits=3),
    prom21_x3=dict(accumulate="truncate", promote_s=2, promote_pv=1, extra_bits=3),
    prom_s=dict(accumulate="truncate", promote_s=1),
    prom_pv=dict(accumulate="truncate", promote_pv=1),
    prom=dict(accumulate="truncate", promote_s=1, promote_pv=1),
    prom2=dict(accumulate="truncate", promote_s=2, promote_pv=2),
)
names = sys.argv[1].split(",") if len(sys.argv) > 1 else list(VARIANTS)
seeds = int(sys.argv[2]) if len(sys.argv) > 2 else 8
seed0 = int(sys.argv[3]) if len(sys.argv) > 3 else 0  # 0: the probe's own seeds
print(f"{'shape':>22} {'measured':>10} " + " ".join(f"{n:>16}" for n in names))
for (d, sq, sk), meas in MEASURED.items():
    bn = _dispatch.tensorcore_config(d, 90, "float32", "highest")[0]
    worst = {n: 0.0 for n in names}
    wthr = {n: 0.0 for n in names}
    fails = {n: 0 for n in names}
    for seed in range(seed0, seed0 + seeds):
        rng = np.random.default_rng([7, d, sq, sk, seed])
        q, k, v = (ref.round_to(rng.standard_normal(s), "float32")
                   for s in ((2, 4, sq, d), (2, 4, sk, d), (2, 4, sk, d)))
        rule = ref.pass_threshold(q, k, v, dtype="float32")
        for n in names:
            o = tensorcore_model(q, k, v, dtype="float32", split=True, bn=bn,
                                 rng=np.random.default_rng(seed), **VARIANTS[n])
            err = float(np.max(np.abs(o - rule.o_ref)))
            worst[n] = max(worst[n], err / rule.naive_err)
            wthr[n] = max(wthr[n], err / rule.threshold)
            fails[n] += not rule.judge(o).passed
    label = f"D={d} Sq={sq} Sk={sk}"
    print(f"{label:>22} {meas:5.2f} ({MFAIL.get((d, sq, sk), 0)}/8) "
          + " ".join(f"{worst[n]:5.2f} {wthr[n]:4.2f} ({fails[n]}/{seeds})" for n in names),
          flush=True)
print("columns: max err/naive, max err/threshold, (seeds failing the rule)")
