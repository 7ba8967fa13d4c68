"""Fresh-input statistics of the float32 3xTF32 kernel's model (tests/kernel_model.py) on single
query rows: B = 2, H = 4, Sq = 1, Sk 64/113/128, D 64/128, N seeds; per variant the max and 90th
percentile of err/threshold under the project rule and the number of seeds failing it. CPU only;
run from the repository root: PYTHONPATH=. python benchmarks/fp32_tc_stats.py 48 old3,new3,new0
(notes/FLOAT32.md)."""
import sys

import numpy as np

sys.path.insert(0, "tests")
from cuflash import reference as ref  # noqa: E402
from kernel_model import tensorcore_model  # noqa: E402

VARIANTS = {
    "rn": dict(accumulate="rn"),
    "old0": dict(accumulate="truncate"),  # the old arithmetic, no guard bits
    "old3": dict(accumulate="truncate", extra_bits=3),
    "new0": dict(accumulate="truncate", promote_s=1, promote_pv=1),  # attn_mma.cu on sm_90
    "new3": dict(accumulate="truncate", promote_s=1, promote_pv=1, extra_bits=3),
    "sm80_3": dict(accumulate="truncate", promote_s=1, extra_bits=3),  # P.V unpromoted
    "pair3": dict(accumulate="truncate", promote_s=2, promote_pv=2, extra_bits=3),
    "comp3": dict(accumulate="truncate", promote_s=1, promote_pv=1, extra_bits=3,
                  compensate=True),
}
n = int(sys.argv[1]) if len(sys.argv) > 1 else 48
names = sys.argv[2].split(",") if len(sys.argv) > 2 else ["old3", "new3", "new0"]
for d in (64, 128):
    for sk in (64, 113, 128):
        res = {x: [] for x in names}
        for seed in range(n):
            rng = np.random.default_rng([11, d, sk, seed])
            q, k, v = (ref.round_to(rng.standard_normal(s), "float32")
                       for s in ((2, 4, 1, d), (2, 4, sk, d), (2, 4, sk, d)))
            rule = ref.pass_threshold(q, k, v, dtype="float32")
            for x in names:
                o = tensorcore_model(q, k, v, dtype="float32", split=True,
                                     bn=64 if d == 64 else 32, rng=np.random.default_rng(seed),
                                     **VARIANTS[x])
                res[x].append(rule.judge(o).frac_threshold)
        print(f"D={d} Sk={sk}: " + "  ".join(
            f"{x}: max {max(r):.2f} p90 {np.quantile(r, 0.9):.2f} fail {sum(t > 1 for t in r)}/{n}"
            for x, r in res.items()), flush=True)
