"""A NumPy model of the Hopper float32 "highest" kernel (kernels_cu/attn_wgmma.cu, T = float,
TERMS = 3) in its two operand forms, for checking their accuracy without a GPU
(notes/FLOAT32.md, "fp16 split"):

- "3xtf32": every operand split into TF32 halves, k8 wgmma steps;
- "3xfp16" (OP = fp16_t): every tile scaled by its own power of two, x 2^e = hi + lo with
  hi = fp16(x 2^e) and lo = fp16(x 2^e - hi) (round to nearest), k16 wgmma steps, and the
  factors taken out exactly afterwards (S / 2^(eq + ek) before the softmax, the tile's P V /
  2^(7 + ev) in the FFMA that adds it to O; P is split as P 2^7).

Both with the truncating tensor-core accumulation of kernel_model.tc_step, in the kernel's
chains: S's large products (hi hi) promoted per step (formed from zero, added to S in IEEE
float32), its small products (hi lo, lo hi) chained over the tile's steps and added at the end;
each key tile's P V from zero over its steps (hi hi, hi lo, lo hi, one chain), added to O in
IEEE float32. The softmax is kernel_model's (lazy rescale, p <= 2^8, one FMA before exp2).
Tiles: Q per block of `bm` query rows, K and V per `bn` keys, within each batch entry.
With `dsplit` (the D = 256 form sketched in notes/FLOAT32.md, "Hopper 3xfp16 at D = 256":
two consumers on the same rows, each owning `dsplit` head-dim columns) each consumer forms its
partial S over its columns in the chains above, (S + s2) of its own, and the partials are added in
IEEE float32 (in shared memory) before the exact scale_pow2; P V is per output column, unchanged.
"""
import math

import numpy as np

from cuflash import reference as ref
from kernel_model import _tf32, softmax_tile, tc_step

P16_LOG2 = 7  # attn_wgmma.cu: pack_p_f16split


def split16_exponent(m):
    """attn_wgmma.cu: split16_exponent. m = max |x| over a tile's finite values (float32)."""
    m = np.asarray(m, dtype=np.float32)
    biased = (m.view(np.uint32) >> 23).astype(np.int64) & 0xFF
    return np.clip(140 - biased, -114, 126)


def _tile_max(x, axis_rows):
    """max |x| over the finite values of each tile of rows (x: (..., rows, D), tiles given as a
    list of slices; attn_wgmma.cu: finite_key), 0 where none is finite."""
    a = np.abs(np.asarray(x, dtype=np.float32))
    a = np.where(np.isfinite(a), a, np.float32(0))
    return [a[..., sl, :].max(axis=(-1, -2)) for sl in axis_rows]


def split_fp16(x, e):
    """(hi, lo) float64 values of fp16(x 2^e) and fp16(x 2^e - hi); x float32 (..., R, C), e per
    batch entry (...), broadcast over the tile."""
    xs = (np.asarray(x, dtype=np.float32).astype(np.float64)
          * np.ldexp(1.0, np.asarray(e))[..., None, None]).astype(np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        hi = xs.astype(np.float16).astype(np.float32)
        lo = (xs - hi).astype(np.float16)
    return hi.astype(np.float64), lo.astype(np.float64)


def split_tf32(x):
    x = np.asarray(x, dtype=np.float32)
    hi = _tf32(x)
    with np.errstate(invalid="ignore"):
        lo = _tf32(x - hi)
    return hi.astype(np.float64), lo.astype(np.float64)


def _steps(n, k):
    return [np.arange(i, min(i + k, n)) for i in range(0, n, k)]


def _scores(qh, ql, kh, kl, ksteps, extra_bits, fused=False):
    """S = Q K^T of one tile pair (split operands, float64 values), the kernel's chains. fused:
    each step's three products chain from zero (hi hi, hi lo, lo hi) and the step's sum is added
    to S in IEEE float32; else the large products alone are promoted so and the small ones chain
    over the tile apart (added at the end)."""
    f32 = np.float32
    kht, klt = np.swapaxes(kh, -1, -2), np.swapaxes(kl, -1, -2)
    shape = np.broadcast_shapes(qh.shape[:-1], kht.shape[:-2] + (1,)) + (kht.shape[-1],)
    s, s2 = np.zeros(shape, f32), np.zeros(shape)
    with np.errstate(invalid="ignore", over="ignore"):
        for idx in ksteps:
            big = tc_step(np.zeros(shape), qh[..., idx], kht[..., idx, :], extra_bits=extra_bits)
            if fused:
                big = tc_step(big, qh[..., idx], klt[..., idx, :], extra_bits=extra_bits)
                big = tc_step(big, ql[..., idx], kht[..., idx, :], extra_bits=extra_bits)
            s = (s + big.astype(f32)).astype(f32)
            if not fused:
                s2 = tc_step(s2, qh[..., idx], klt[..., idx, :], extra_bits=extra_bits)
                s2 = tc_step(s2, ql[..., idx], kht[..., idx, :], extra_bits=extra_bits)
        return (s + s2.astype(f32)).astype(f32)


def _pv(ph, pl, vh, vl, ksteps, extra_bits, o=None, f=1.0, fused=False, tile_sum=True):
    """One key tile's P V (split operands). o None: from zero, one chain of hi hi, hi lo, lo hi a
    step (returned as float64 values). o (float32): promoted, each step's hi hi from zero; with
    tile_sum (the kernels' form) the steps' products are summed in IEEE float32 over the tile,
    the small products chained over the tile join that sum, and o takes it in one FFMA
    (o + (sum + small) f); without, each step's product goes into o as o + t f (one FFMA a
    step) and the small products the same way after the tile (the kernels' form before
    2026-12-07; attn_mma.cu's still from D = 192 on); with fused, each step's three products
    chain from zero and their sum goes into o a step (no chain over the tile)."""
    shape = np.broadcast_shapes(ph.shape[:-1], vh.shape[:-2] + (1,)) + (vh.shape[-1],)
    ot = np.zeros(shape)
    f32 = np.float32
    tsum = None
    with np.errstate(invalid="ignore", over="ignore"):
        for idx in ksteps:
            if o is None:
                ot = tc_step(ot, ph[..., idx], vh[..., idx, :], extra_bits=extra_bits)
            else:
                t = tc_step(np.zeros(shape), ph[..., idx], vh[..., idx, :], extra_bits=extra_bits)
                if fused:
                    t = tc_step(t, ph[..., idx], vl[..., idx, :], extra_bits=extra_bits)
                    t = tc_step(t, pl[..., idx], vh[..., idx, :], extra_bits=extra_bits)
                    o = (o.astype(np.float64) + t * f).astype(f32)
                    continue
                if tile_sum:
                    tsum = t.astype(f32) if tsum is None else (tsum + t.astype(f32)).astype(f32)
                else:
                    o = (o.astype(np.float64) + t * f).astype(f32)
            ot = tc_step(ot, ph[..., idx], vl[..., idx, :], extra_bits=extra_bits)
            ot = tc_step(ot, pl[..., idx], vh[..., idx, :], extra_bits=extra_bits)
        if o is None:
            return ot
        if fused:
            return o
        if tile_sum and tsum is not None:
            ot = (tsum + ot.astype(f32)).astype(f32).astype(np.float64)
        return (o.astype(np.float64) + ot * f).astype(f32)


def hopper_f32_model(q, k, v, *, causal=False, scale=None, form="3xfp16", bm=128, bn=64,
                     rng=None, extra_bits=0, kstep=None, promote_pv=None, fused=False,
                     p16_log2=P16_LOG2, lazy=True, dsplit=None, tile_sum=True):
    """float64 output of the modelled Hopper float32 "highest" kernel on float32-representable
    inputs q (..., Sq, D), k, v (..., Sk, D), equal batch shapes.

    form: "3xfp16" or "3xtf32". kstep: products per tensor-core accumulation step (default the
    instruction's k: 16 for fp16, 8 for TF32; 8 for fp16 models a k16 instruction that truncates
    after each half). rng: perturbs every exp2 by up to 2^-22 relative (None: none).
    promote_pv: P V's large products promoted per step (formed from zero and added in IEEE
    float32: to the tile's sum with tile_sum, else to O; as attn_mma.cu does on sm_90, and
    attn_wgmma.cu's 3xfp16 form: the default for it) instead of the tile's chain from zero
    (attn_wgmma.cu's 3xTF32 form: the default for it). fused: each step's three products in one chain from
    zero, promoted into S (and, with promote_pv, into O). dsplit: head-dim columns per consumer
    of S (None: one consumer takes all D); each consumer's partial S in its own chains, the
    partials added in float32 in consumer order (two partials: the order does not matter).
    tile_sum (with promote_pv): each key tile's promoted P V products summed in IEEE float32 and
    added to O once (attn_wgmma.cu's 3xfp16 form; attn_mma.cu's up to D = 128), else each step's
    product added to O (attn_mma.cu from D = 192 on: _pv)."""
    if form not in ("3xfp16", "3xtf32"):
        raise ValueError(f"form: '3xfp16' or '3xtf32', got {form!r}")
    f16 = form == "3xfp16"
    kstep = kstep or (16 if f16 else 8)
    promote_pv = f16 if promote_pv is None else promote_pv
    f32 = np.float32
    q32, k32, v32 = (np.asarray(x, dtype=f32) for x in (q, k, v))
    sq, sk, d = q32.shape[-2], k32.shape[-2], q32.shape[-1]
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    c = f32(scale * math.log2(math.e))
    batch = np.broadcast_shapes(q32.shape[:-2], k32.shape[:-2], v32.shape[:-2])
    q32, k32, v32 = (np.broadcast_to(x, batch + x.shape[-2:]) for x in (q32, k32, v32))
    out = np.zeros(batch + (sq, v32.shape[-1]))
    ktiles = [slice(j0, min(sk, j0 + bn)) for j0 in range(0, sk, bn)]
    if f16:
        ek = [split16_exponent(mx) for mx in _tile_max(k32, ktiles)]
        ev = [split16_exponent(mx) for mx in _tile_max(v32, ktiles)]
    if dsplit is not None and (dsplit <= 0 or dsplit % kstep):
        raise ValueError(f"dsplit must be a positive multiple of the step ({kstep}), got {dsplit}")
    dsplit = d if dsplit is None else dsplit
    # per consumer: its columns' steps (columns past D are the zero padding: they add nothing)
    dparts = [[idx + c0 for idx in _steps(min(d, c0 + dsplit) - c0, kstep)]
              for c0 in range(0, d, dsplit)]

    with np.errstate(invalid="ignore", over="ignore"):
        for i0 in range(0, sq, bm):
            rows = slice(i0, min(sq, i0 + bm))
            qt = q32[..., rows, :]
            if f16:
                eq = split16_exponent(_tile_max(qt, [slice(None)])[0])
                qh, ql = split_fp16(qt, eq)
            else:
                qh, ql = split_tf32(qt)
            nq = qt.shape[-2]
            m = np.full(batch + (nq,), -np.inf, f32)
            l = np.zeros(batch + (nq,), f32)
            o = np.zeros(batch + (nq, v32.shape[-1]), f32)
            for j, kt in enumerate(ktiles):
                if f16:
                    kh, kl = split_fp16(k32[..., kt, :], ek[j])
                    vh, vl = split_fp16(v32[..., kt, :], ev[j])
                else:
                    kh, kl = split_tf32(k32[..., kt, :])
                    vh, vl = split_tf32(v32[..., kt, :])
                s = None
                for steps in dparts:  # one partial S a consumer, summed in float32
                    part = _scores(qh, ql, kh, kl, steps, extra_bits, fused)
                    s = part if s is None else (s + part).astype(f32)
                if f16:  # exact (scale_pow2): S of the inputs
                    s = (s.astype(np.float64)
                         * np.ldexp(1.0, -(eq + ek[j]))[..., None, None]).astype(f32)
                if causal:
                    keep = (np.arange(kt.start, kt.stop)[None, :]
                            <= np.arange(i0, i0 + nq)[:, None] + (sk - sq))
                    s = np.where(keep, s, f32(-np.inf))
                p, m, l, alpha = softmax_tile(s, m, l, c, rng, 8.0 if lazy else 0.0)
                o = (o * alpha[..., None]).astype(f32)
                psteps = _steps(p.shape[-1], 16 if f16 else 8)
                if f16:
                    pp = (p * f32(2 ** p16_log2)).astype(f32)
                    ph = pp.astype(np.float16).astype(f32)
                    pl = (pp - ph).astype(np.float16)
                    f = np.ldexp(1.0, -(p16_log2 + ev[j]))[..., None, None]
                    ph, pl = ph.astype(np.float64), pl.astype(np.float64)
                else:
                    f = 1.0
                    ph, pl = split_tf32(p)
                if promote_pv:
                    o = _pv(ph, pl, vh, vl, psteps, extra_bits, o=o, f=f, fused=fused,
                            tile_sum=tile_sum)
                else:  # the tile's sum from zero, then one FFMA (FADD for TF32) into O
                    o = (o.astype(np.float64)
                         + _pv(ph, pl, vh, vl, psteps, extra_bits) * f).astype(f32)
            inv = np.where(l == 0, f32(0), f32(1) / np.where(l == 0, f32(1), l)).astype(f32)
            out[..., rows, :] = (o * inv[..., None]).astype(f32)
    return ref.round_to(out, "float32")
