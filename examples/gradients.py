"""cuflash.attention_backward: gradients of attention, on the GPU when there is one (else on the
NumPy path), checked against the float64 reference under the project's gradient rule.

    python examples/gradients.py     # with cuflash installed (or PYTHONPATH=. from the repo root)

Multi-query attention: one key/value head shared by 8 query heads, so dk and dv come back with
k's and v's shapes, summed over the query heads that use them.
"""
import numpy as np

import cuflash
from cuflash import reference

B, H, S, D = 2, 8, 256, 64
rng = np.random.default_rng(0)
dtype = "float16"
q = reference.round_to(rng.standard_normal((B, H, S, D)), dtype)
k = reference.round_to(rng.standard_normal((B, 1, S, D)), dtype)   # one key/value head
v = reference.round_to(rng.standard_normal((B, 1, S, D)), dtype)
do = reference.round_to(rng.standard_normal((B, H, S, D)), dtype)  # dL/do from the model

if cuflash.gpu_available():
    import cupy as xp
else:
    xp = np
args = [xp.asarray(x.astype(dtype)) for x in (q, k, v, do)]
o, lse = cuflash.attention(*args[:3], causal=True, return_lse=True)
dq, dk, dv = cuflash.attention_backward(args[3], *args[:3], o, lse, causal=True)
plan = cuflash.backward_dispatch_info(args[3], *args[:3], o, lse, causal=True)

g_ref = reference.attention_backward_ref(do, q, k, v, causal=True)
tols, naive = reference.grad_pass_threshold(do, q, k, v, causal=True, dtype=dtype, ref=g_ref)
print(f"{plan}: dq {dq.shape}, dk {dk.shape}, dv {dv.shape}")
ok = True
for name, g, r, tol, ne in zip(("dq", "dk", "dv"), (dq, dk, dv), g_ref, tols, naive):
    g = g.get() if hasattr(g, "get") else g
    err = float(np.max(np.abs(g.astype(np.float64) - r)))
    ok &= err <= tol
    print(f"  {name}: max abs error {err:.3e}   naive {dtype} backward {ne:.3e}   "
          f"threshold {tol:.3e}   {'PASS' if err <= tol else 'FAIL'}")
raise SystemExit(0 if ok else 1)
