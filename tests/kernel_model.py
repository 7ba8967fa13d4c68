"""A NumPy model of the tensor-core kernels' arithmetic (kernels_cu/common.cuh softmax_step and
the P.V product of attn_mma.cu / attn_wgmma.cu), for checking the a-priori error bound of
`cuflash.reference.error_bound` without a GPU.

Per key tile of `bn` keys: raw scores q.k in float32, p = exp2(fma(s, c, -m c)) in float32 with
c = scale * log2(e) folded in and a relative error of up to 2^-22 (ex2.approx is 2 ulp), lazy
rescaling (the reference max moves only when the tile max exceeds it by more than 2^8 in exp2
units, so p <= 2^8), l summed from the float32 p, P rounded to the dtype for the P.V product
(float32 accumulation), one reciprocal and one multiplication at the end, and the output rounded
to the dtype. For float32, `split=True` models a split-precision tensor-core path (3xTF32): each
operand x = hi + lo with hi and lo rounded to TF32 (10 stored mantissa bits) and every product
formed as hi*hi + hi*lo + lo*hi, for the scores and for P.V.
"""
import math

import numpy as np

from cuflash import reference as ref

RESCALE_LOG2 = 8.0


def _round_p(p32, dtype):
    if dtype == "float16":
        return p32.astype(np.float16).astype(np.float32)
    if dtype == "bfloat16":
        return ref.round_to(p32, "bfloat16").astype(np.float32)
    return p32


def _tf32(x):
    """float32 -> nearest TF32 value (10 stored mantissa bits), kept as float32."""
    b = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    r = ((b + np.uint32(0x1000)) & np.uint32(0xFFFFE000)).astype(np.uint32)
    return np.where(np.isfinite(x), r.view(np.float32), x).astype(np.float32)


def _split_matmul(a, b):
    """a @ b in float32 from TF32 halves: hi*hi + hi*lo + lo*hi (3xTF32)."""
    a_hi, b_hi = _tf32(a), _tf32(b)
    a_lo, b_lo = _tf32(a - a_hi), _tf32(b - b_hi)
    return (np.matmul(a_hi, b_lo) + np.matmul(a_lo, b_hi) + np.matmul(a_hi, b_hi)).astype(np.float32)


def tensorcore_model(q, k, v, *, causal=False, scale=None, dtype, bn=64, rng=None, split=False):
    """float64 output of the modelled kernel on float64 inputs representable in `dtype`.

    q (..., Sq, D), k and v (..., Sk, D/Dv) with equal batch shapes. `rng`: perturbs every exp2
    by a random relative error of up to 2^-22 (None: no perturbation)."""
    f32 = np.float32
    q32, k32, v32 = (np.asarray(x, dtype=f32) for x in (q, k, v))
    sq, sk = q32.shape[-2], k32.shape[-2]
    if scale is None:
        scale = 1.0 / math.sqrt(q32.shape[-1])
    c = f32(scale * math.log2(math.e))
    batch = np.broadcast_shapes(q32.shape[:-2], k32.shape[:-2], v32.shape[:-2])
    m = np.full(batch + (sq,), -np.inf, f32)
    l = np.zeros(batch + (sq,), f32)
    o = np.zeros(batch + (sq, v32.shape[-1]), f32)

    def ex2(x):
        y = np.exp2(x.astype(f32))
        if rng is not None:
            y = (y.astype(np.float64) * (1 + rng.uniform(-2.0 ** -22, 2.0 ** -22, y.shape))).astype(f32)
        return y

    with np.errstate(invalid="ignore", over="ignore"):
        for j0 in range(0, sk, bn):
            j1 = min(sk, j0 + bn)
            mm = _split_matmul if split else np.matmul
            s = mm(q32, np.swapaxes(k32[..., j0:j1, :], -1, -2))
            if causal:
                keep = np.arange(j0, j1)[None, :] <= np.arange(sq)[:, None] + (sk - sq)
                s = np.where(keep, s, f32(-np.inf))
            mx = np.maximum(m, s.max(axis=-1))
            grow = (mx - m) * c > RESCALE_LOG2
            alpha = np.where(grow, np.exp2(((m - mx) * c).astype(f32)), f32(1)).astype(f32)
            m = np.where(grow, mx, m)
            m_c = np.where(m == -np.inf, 0.0, (m * c).astype(f32).astype(np.float64))
            arg = (s.astype(np.float64) * float(c) - m_c[..., None]).astype(f32)  # one FMA
            p = ex2(arg)
            l = (l * alpha + p.sum(axis=-1, dtype=f32)).astype(f32)
            o = (o * alpha[..., None] + mm(_round_p(p, dtype), v32[..., j0:j1, :])).astype(f32)
        inv = np.where(l == 0, f32(0), f32(1) / np.where(l == 0, f32(1), l)).astype(f32)
        out = (o * inv[..., None]).astype(f32)
    return ref.round_to(out.astype(np.float64), dtype)
