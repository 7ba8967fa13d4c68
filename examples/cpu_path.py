"""cuflash.attention on NumPy arrays (the CPU path), checked against the float64 reference.

    python examples/cpu_path.py      # with cuflash installed (or PYTHONPATH=. from the repo root)
"""
import numpy as np

import cuflash
from cuflash.reference import attention_ref

B, H, S, D = 2, 4, 128, 64
rng = np.random.default_rng(0)

for dtype in (np.float16, np.float32, np.float64):
    q, k, v = (rng.standard_normal((B, H, S, D)).astype(dtype) for _ in range(3))
    for causal in (False, True):
        o, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
        o_ref, lse_ref = attention_ref(q, k, v, causal=causal)
        err_o = np.max(np.abs(o.astype(np.float64) - o_ref))
        err_lse = np.max(np.abs(lse.astype(np.float64) - lse_ref))
        kernel = cuflash.dispatch_info(q, k, v, causal=causal)
        print(f"{np.dtype(dtype).name:8s} causal={causal!s:5s}  {kernel:10s}  o {o.dtype}{o.shape}"
              f"  max|o - o_ref| = {err_o:.3e}   max|lse - lse_ref| = {err_lse:.3e}")
