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

`accumulate="truncate"` (float32, split=True) models the tensor cores' own float32 accumulation
inside each mma.sync m16n8k8 step instead of round-to-nearest sums: see `tc_step` for the exact
model and `tensorcore_model` for the kernel's chains (which products share an accumulator, over
how many k-steps, and where IEEE float32 additions take over), old (`promote=0`) and promoted.
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


def _tf32_split(x):
    """x (float32 values) -> (hi, lo) TF32 halves as float64 (Tf32Split<3> in common.cuh)."""
    x = np.asarray(x, dtype=np.float32)
    hi = _tf32(x)
    return hi.astype(np.float64), _tf32(x - hi).astype(np.float64)


def _trunc_to(x, exp_lead, bits):
    """x truncated toward zero to a multiple of 2^(exp_lead - bits + 1) (float64, exact)."""
    ulp = np.ldexp(1.0, exp_lead - bits + 1)
    return np.trunc(x / ulp) * ulp


def tc_step(c, a, b, *, extra_bits=0):
    """One k-step of a TF32 mma.sync with float32 accumulation, as the truncating model has it.

    d = c + sum_k a[..., m, k] * b[..., k, n] over the step's K (<= 8) terms, with
    c (..., M, N) float32 values, a (..., M, K) and b (..., K, N) TF32 values (all float64).
    The model (after Fasi, Higham, Mikaitis and Pranesh, "Numerical behavior of NVIDIA tensor
    cores", PeerJ CS 2021, who found it on V100/T4/A100; Khattak and Mikaitis 2025 extend the
    study to H100/B200): (1) each product a*b is exact (11 x 11 significant bits); (2) the K
    products and c are aligned to the largest exponent among them, E, and each addend is
    truncated (toward zero, sign-magnitude) to the bits from 2^E down to 2^(E - 23 - extra_bits),
    i.e. float32's 24-bit significand at the largest addend's exponent plus `extra_bits` guard
    bits; (3) the truncated addends are summed exactly; (4) the sum is normalised and truncated
    toward zero to float32 (24 bits). Order of the products does not matter in this model.
    Computed exactly in float64: every truncated addend is an integer multiple of the alignment
    unit below 2^(24 + extra_bits), so K + 1 of them sum exactly (K + 1 <= 9, extra_bits <= 20)."""
    prod = a[..., :, None, :] * np.swapaxes(b, -1, -2)[..., None, :, :]  # (..., M, N, K), exact
    terms = np.concatenate([np.broadcast_to(c, prod.shape[:-1])[..., None], prod], axis=-1)
    mx = np.max(np.abs(terms), axis=-1)
    _, e = np.frexp(np.where(mx > 0, mx, 1.0))  # mx = f 2^e, 1/2 <= f < 1: leading bit 2^(e-1)
    lead = (e - 1)[..., None]
    s = np.sum(_trunc_to(terms, lead, 24 + extra_bits), axis=-1)
    _, es = np.frexp(np.where(s != 0, s, 1.0))
    return np.where(s != 0, _trunc_to(s, es - 1, 24), 0.0)


def _score_steps(d):
    """Head-dim columns of each k8 step of the float32 scores (attn_mma.cu, Mma32Ops::scores):
    per 16-column block, step 0 takes columns 4 t4 and 4 t4 + 1 (t4 = 0..3), step 1 the rest."""
    steps = []
    for kc in range(0, d, 16):
        steps.append([kc + 4 * t + i for t in range(4) for i in (0, 1) if kc + 4 * t + i < d])
        steps.append([kc + 4 * t + i for t in range(4) for i in (2, 3) if kc + 4 * t + i < d])
    return [np.array(st) for st in steps if st]


def _two_sum(x, y):
    """float32 x + y and its exact rounding error (Knuth's TwoSum, 6 IEEE additions)."""
    f32 = np.float32
    x, y = x.astype(f32), y.astype(f32)
    s = (x + y).astype(f32)
    bp = (s - x).astype(f32)
    err = ((x - (s - bp).astype(f32)).astype(f32) + (y - bp).astype(f32)).astype(f32)
    return s, err


def _tc_split_product(a, b, steps, *, promote, extra_bits, compensate=False, start=None):
    """a @ b (float32 values; a (..., M, K), b (..., K, N)) as the TERMS = 3 kernel forms it over
    the k8 steps `steps` (index arrays into K) with truncating tensor-core accumulation.

    Per step, in the kernel's order (common.cuh: mma_f32): small += a_lo b_hi, small += a_hi b_lo
    (one chain over all steps), then the large product a_hi b_hi. promote = 0: the large products
    chain through one accumulator (`big`, the old form). promote = N >= 1: the large products of N
    consecutive steps chain from a zeroed fragment, which is then added to `big` with an IEEE
    float32 addition (N = 1: every step promoted). compensate (with promote): that addition is
    a TwoSum whose rounding error goes to a float32 compensation term, added to `small` at the
    end (a costlier alternative, 7 FADD per element and step; not what the kernel does).
    start (float32, promote only): `big` starts there instead of at zero (the kernel's P.V, whose
    large products are promoted straight into O). Returns float32 big + small (IEEE)."""
    a_hi, a_lo = _tf32_split(a)
    b_hi, b_lo = _tf32_split(b)
    shape = np.broadcast_shapes(a.shape[:-1], b.shape[:-2] + (1,)) + (b.shape[-1],)
    big, small, grp, comp = (np.zeros(shape) for _ in range(4))
    if start is not None:
        if not promote:
            raise ValueError("start: the promoted form only")
        big = np.broadcast_to(np.asarray(start, dtype=np.float32), shape).astype(np.float64)
    f32 = np.float32
    for i, idx in enumerate(steps):
        ah, al, bh, bl = a_hi[..., idx], a_lo[..., idx], b_hi[..., idx, :], b_lo[..., idx, :]
        small = tc_step(small, al, bh, extra_bits=extra_bits)
        small = tc_step(small, ah, bl, extra_bits=extra_bits)
        if promote:
            grp = tc_step(grp if i % promote else np.zeros(shape), ah, bh, extra_bits=extra_bits)
            if (i + 1) % promote == 0 or i + 1 == len(steps):
                if compensate:
                    big, err = _two_sum(big, grp)
                    comp = (comp.astype(f32) + err).astype(f32)
                else:
                    big = (big.astype(f32) + grp.astype(f32)).astype(f32)
                big = big.astype(np.float64)
        else:
            big = tc_step(big, ah, bh, extra_bits=extra_bits)
    if compensate:
        small = (small.astype(f32) + comp.astype(f32)).astype(f32)
    return (big.astype(f32) + small.astype(f32)).astype(f32)


def perturbed_exp2(x, rng):
    """exp2 of float32 x in float32; with `rng`, times a random relative error of up to 2^-22
    (ex2.approx is 2 ulp)."""
    y = np.exp2(x.astype(np.float32))
    if rng is not None:
        y = (y.astype(np.float64) * (1 + rng.uniform(-2.0 ** -22, 2.0 ** -22, y.shape))).astype(np.float32)
    return y


def softmax_tile(s, m, l, c, rng, rescale_log2=RESCALE_LOG2):
    """One key tile of the kernels' online softmax (common.cuh: softmax_step, lazy rescale; with
    rescale_log2 = 0 every rescale is taken, LAZY = false) on float32 scores s (..., rows, keys)
    with c = scale log2(e): returns (p, m, l, alpha), where O must be multiplied by alpha (per
    row) before the tile's P V is added."""
    f32 = np.float32
    mx = np.maximum(m, s.max(axis=-1))
    grow = (mx - m) * c > rescale_log2
    alpha = np.where(grow, np.exp2(((m - mx) * c).astype(f32)), f32(1)).astype(f32)
    m = np.where(grow, mx, m)
    m_c = np.where(m == -np.inf, 0.0, (m * c).astype(f32).astype(np.float64))
    arg = (s.astype(np.float64) * float(c) - m_c[..., None]).astype(f32)  # one FMA
    p = perturbed_exp2(arg, rng)
    l = (l * alpha + p.sum(axis=-1, dtype=f32)).astype(f32)
    return p, m, l, alpha


def tensorcore_model(q, k, v, *, causal=False, scale=None, dtype, bn=64, rng=None, split=False,
                     accumulate="rn", promote_s=0, promote_pv=0, extra_bits=0, compensate=False):
    """float64 output of the modelled kernel on float64 inputs representable in `dtype`.

    q (..., Sq, D), k and v (..., Sk, D/Dv) with equal batch shapes. `rng`: perturbs every exp2
    by a random relative error of up to 2^-22 (None: no perturbation).

    accumulate="truncate" (float32 with split=True only): every tensor-core product step is
    `tc_step` (truncating alignment and result, `extra_bits` guard bits), with the kernel's
    chains: the scores over the D/8 k8 steps of each key tile (small products apart, added at
    the end); P.V per key tile over its bn/8 key steps. promote_s / promote_pv: 0 for the old
    form (the large products chain through the tensor-core accumulator; for P.V from zero over
    the tile, then O + (big + small) in IEEE float32), N for the promoted form (each N steps'
    large products from a zeroed fragment, then an IEEE float32 addition to S, or to O itself
    for P.V, whose tile's small products follow after the tile; see `_tc_split_product`).
    attn_mma.cu now runs promote_s = promote_pv = 1. compensate: those additions as TwoSums
    with a compensation term (an alternative the notes weigh)."""
    if accumulate not in ("rn", "truncate"):
        raise ValueError(f"accumulate: 'rn' or 'truncate', got {accumulate!r}")
    if accumulate == "truncate" and not (split and dtype == "float32"):
        raise ValueError("accumulate='truncate' models the float32 split kernel: "
                         "dtype='float32', split=True")
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

    with np.errstate(invalid="ignore", over="ignore"):
        for j0 in range(0, sk, bn):
            j1 = min(sk, j0 + bn)
            mm = _split_matmul if split else np.matmul
            if accumulate == "truncate":
                s = _tc_split_product(q32, np.swapaxes(k32[..., j0:j1, :], -1, -2),
                                      _score_steps(q32.shape[-1]), promote=promote_s,
                                      extra_bits=extra_bits, compensate=compensate)
            else:
                s = mm(q32, np.swapaxes(k32[..., j0:j1, :], -1, -2))
            if causal:
                keep = np.arange(j0, j1)[None, :] <= np.arange(sq)[:, None] + (sk - sq)
                s = np.where(keep, s, f32(-np.inf))
            p, m, l, alpha = softmax_tile(s, m, l, c, rng)
            if accumulate == "truncate":
                # Keys past Sk arrive as zeros (V rows and P alike): the tile's steps are 8 keys.
                steps = [np.arange(i, min(i + 8, j1 - j0)) for i in range(0, j1 - j0, 8)]
                o = (o * alpha[..., None]).astype(f32)
                if promote_pv:  # large products into O, then O + the tile's small products
                    o = _tc_split_product(p, v32[..., j0:j1, :], steps, promote=promote_pv,
                                          extra_bits=extra_bits, compensate=compensate, start=o)
                else:  # the tile's sum from zero, then O + (big + small)
                    o = (o + _tc_split_product(p, v32[..., j0:j1, :], steps, promote=0,
                                               extra_bits=extra_bits)).astype(f32)
            else:
                o = ((o * alpha[..., None]).astype(f32)
                     + mm(_round_p(p, dtype), v32[..., j0:j1, :])).astype(f32)
        inv = np.where(l == 0, f32(0), f32(1) / np.where(l == 0, f32(1), l)).astype(f32)
        out = (o * inv[..., None]).astype(f32)
    return ref.round_to(out.astype(np.float64), dtype)
