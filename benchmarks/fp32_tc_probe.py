"""Error of the float32 3xTF32 tensor-core forward against the project's rule, on short rows:
which (D, Sk) exceed 2x naive, on how many of 8 seeds (fixed: benchmarks/fp32_tc_model.py models
the same inputs). Needs a GPU; from the repository root: PYTHONPATH=. python
benchmarks/fp32_tc_probe.py (notes/FLOAT32.md has the H200 numbers of 2026-12-01)."""
import cupy as cp
import numpy as np

import cuflash
from cuflash import reference as ref

for d in (64, 128):
    for sq, sk in ((1, 64), (1, 113), (16, 113), (1, 128), (64, 200), (1, 1000), (113, 113)):
        worst, fails = 0.0, 0
        for seed in range(8):
            rng = np.random.default_rng([7, d, sq, sk, seed])
            q, k, v = (ref.round_to(rng.standard_normal(s), "float32") for s in ((2, 4, sq, d), (2, 4, sk, d), (2, 4, sk, d)))
            o = cuflash.attention(*(cp.asarray(x.astype(np.float32)) for x in (q, k, v)), kernel="tensorcore")
            rule = ref.pass_threshold(q, k, v, dtype="float32")
            og = cp.asnumpy(o).astype(np.float64)
            worst = max(worst, float(np.max(np.abs(og - rule.o_ref))) / rule.naive_err)
            fails += not rule.judge(og).passed
        print(f"D={d:4d} Sq={sq:4d} Sk={sk:5d}: max err/naive {worst:5.2f}, rule failed on {fails}/8 seeds", flush=True)
