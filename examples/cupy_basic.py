"""Attention on CuPy arrays: causal self-attention for a batch of heads, with the log-sum-exp.

    python examples/cupy_basic.py          # needs a CUDA GPU and CuPy
"""
import cupy as cp
import numpy as np

import cuflash
from cuflash import reference

B, H, S, D = 2, 8, 1024, 64
rng = np.random.default_rng(0)
q, k, v = (cp.asarray(rng.standard_normal((B, H, S, D)), dtype=cp.float16) for _ in range(3))

print("kernel:", cuflash.dispatch_info(q, k, v, causal=True))
o, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)   # CuPy arrays, current stream
print("o:", o.shape, o.dtype, " lse:", lse.shape, lse.dtype)

# Check one head against the float64 SciPy reference.
qh, kh, vh = (cp.asnumpy(x[0, 0]).astype(np.float64) for x in (q, k, v))
o_ref, lse_ref = reference.attention_ref(qh, kh, vh, causal=True)
print("max |o - o_ref| =", float(np.max(np.abs(cp.asnumpy(o[0, 0]).astype(np.float64) - o_ref))))
print("max |lse - lse_ref| =", float(np.max(np.abs(cp.asnumpy(lse[0, 0]) - lse_ref))))

# Preallocated output, own stream: no allocation, no synchronisation (capturable in a CUDA graph).
out = cp.empty_like(q)
stream = cp.cuda.Stream(non_blocking=True)
cuflash.attention(q, k, v, causal=True, out=out, stream=stream)
stream.synchronize()
print("same result on another stream:", bool(cp.array_equal(out, o)))
