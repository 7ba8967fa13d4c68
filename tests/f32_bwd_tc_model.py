"""A NumPy model of the float32 tensor-core backward (kernels_cu/attn_bwd_mma.cu, T = float,
OP = fp16_t, "3xfp16", with its stats pass cuflash_bwd_stats_mma), for checking its accuracy
against the gradient pass rule without a GPU (notes/BACKWARD.md, "float32 on the tensor cores").

The arithmetic as the kernels have it, with the truncating tensor-core accumulation of
kernel_model.tc_step (each k16 step's products exact, aligned to the largest addend and
truncated to float32's 24 bits, the sum truncated):
- every float32 tile (K, V per key block of `bn` keys; Q, dO per query tile of `bm` rows; the
  stats pass: Q, dO per `bms` rows, K, V per `bns` keys) scaled by its own power of two
  (split16_exponent) and split into fp16 hi + lo (fp16split_model.split_fp16);
- every product a sum over k16 steps of t = hi hi (from zero) and u = hi lo + lo hi (one chain
  from zero), each added to a float32 accumulator in IEEE arithmetic, times the step's power of
  two (exact);
- P = exp(s scale - m) / l (float32 exp, times 1 / l) with m, l, delta from the stats pass,
  split as P 2^13; dS = P (dP - delta) with P as split (hi + lo), split per 16 keys and half
  query tile with the exponent of its own max (clamped as the kernel clamps it).
Rows without keys, NaN and infinity are not modelled (the GPU tests cover them)."""
import math

import numpy as np

from cuflash import reference as ref
from fp16split_model import _steps, split16_exponent, split_fp16
from kernel_model import tc_step

BWD_P16_LOG2 = 13  # attn_bwd_mma.cu
F32 = np.float32


def _split(x):
    """(hi, lo, e) of a float32 tile (rows, D) split with its own exponent."""
    a = np.abs(x[np.isfinite(x)])
    e = int(split16_exponent(a.max() if a.size else F32(0)))
    hi, lo = split_fp16(x, e)
    return hi, lo, e


def _acc(acc, ah, al, bh, bl, fs, extra_bits=0):
    """acc (M, N) float32 += sum over the k16 steps i of fs[i] (A_i B_i): A (M, K), B (K, N)
    split values (float64); per step t = hi hi and u = hi lo + lo hi from zero, each added to acc
    through one IEEE FFMA by fs[i] (a power of two)."""
    kdim = ah.shape[-1]
    for i, idx in enumerate(_steps(kdim, 16)):
        z = np.zeros(acc.shape)
        t = tc_step(z, ah[:, idx], bh[idx, :], extra_bits=extra_bits)
        u = tc_step(z, ah[:, idx], bl[idx, :], extra_bits=extra_bits)
        u = tc_step(u, al[:, idx], bh[idx, :], extra_bits=extra_bits)
        f = float(fs[i]) if np.ndim(fs) else float(fs)
        acc = (acc.astype(np.float64) + t * f).astype(F32)
        acc = (acc.astype(np.float64) + u * f).astype(F32)
    return acc


def _visible(rows, keys, sq, sk, causal):
    ok = (keys[None, :] < sk) & (rows[:, None] < sq)
    if causal:
        ok &= keys[None, :] <= rows[:, None] + (sk - sq)
    return ok


def _stats(q, k, v, do, scale, causal, bms, bns, fma=False):
    """m, l, delta per row (one batch entry) as cuflash_bwd_stats_mma forms them."""
    sq, sk = q.shape[0], k.shape[0]
    m = np.full(sq, -np.inf, F32)
    l = np.zeros(sq, F32)
    ds = np.zeros(sq, F32)
    for i0 in range(0, sq, bms):
        rows = np.arange(i0, min(sq, i0 + bms))
        qh, ql, eq = _split(q[rows])
        dh, dl, ed = _split(do[rows])
        mr, lr, dr = m[rows], l[rows], ds[rows]
        for j0 in range(0, sk, bns):
            keys = np.arange(j0, min(sk, j0 + bns))
            kh, kl, ek = _split(k[keys])
            vh, vl, ev = _split(v[keys])
            s = _acc(np.zeros((len(rows), len(keys)), F32), qh, ql, kh.T, kl.T, 1.0)
            s = (s * np.ldexp(1.0, -(eq + ek))).astype(F32)
            dp = _acc(np.zeros((len(rows), len(keys)), F32), dh, dl, vh.T, vl.T, 1.0)
            dp = (dp * np.ldexp(1.0, -(ed + ev))).astype(F32)
            ok = _visible(rows, keys, sq, sk, causal)
            x = np.where(ok, (s * F32(scale)).astype(F32), F32(-np.inf))
            m_new = np.maximum(mr, x.max(axis=1))
            with np.errstate(invalid="ignore"):
                alpha = np.where(m_new == -np.inf, F32(0), np.exp(mr - m_new)).astype(F32)
                if fma:  # (experiment) expf(fmaf(s, scale, -m)): one rounding of the exponent
                    xe = (s.astype(np.float64) * float(F32(scale)) - m_new[:, None]).astype(F32)
                else:
                    xe = (x - m_new[:, None]).astype(F32)
                p = np.where(m_new[:, None] == -np.inf, F32(0),
                             np.where(ok, np.exp(xe), F32(0))).astype(F32)
            lr = (lr * alpha + p.sum(axis=1, dtype=F32)).astype(F32)
            dr = (dr * alpha + np.where(ok, p * dp, F32(0)).sum(axis=1, dtype=F32)).astype(F32)
            mr = m_new
        m[rows], l[rows], ds[rows] = mr, lr, dr
    empty = l == 0
    delta = np.where(empty, F32(0), (ds / np.where(empty, F32(1), l)).astype(F32))
    return np.where(empty, F32(np.inf), m), np.where(empty, F32(1), l), delta


def f32_tc_backward_model(do, q, k, v, *, causal=False, scale=None, bm=32, bn=64, bms=64,
                          bns=64, extra_bits=0, exact=()):
    """float64 (dq, dk, dv) of the modelled kernels on float32-representable inputs
    (..., S, D) with equal batch shapes; tiles as _dispatch.TC_BWD_F16SPLIT_CONFIGS and
    TC_BWD_STATS_CONFIGS (D = 64). `exact`: experiments, not the kernel: "p" / "ds" P's / dS's
    split without rounding, "fma" the exponent as one fmaf(s, scale, -m), "div" P = exp / l.
    (None of them moved the Sq = 1 failures: notes/BACKWARD.md, "float32 on the tensor
    cores".)"""
    q, k, v, do = (np.asarray(x, dtype=F32) for x in (q, k, v, do))
    batch = q.shape[:-2]
    sq, sk, d = q.shape[-2], k.shape[-2], q.shape[-1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    dq, dk, dv = (np.zeros(x.shape, F32) for x in (q, k, v))
    p_unit = np.ldexp(1.0, -BWD_P16_LOG2)
    for b in np.ndindex(*batch):
        qb, kb, vb, dob = q[b], k[b], v[b], do[b]
        m, l, delta = _stats(qb, kb, vb, dob, scale, causal, bms, bns, "fma" in exact)
        linv = (F32(1) / l).astype(F32)
        dqa = np.zeros((sq, d), F32)
        for j0 in range(0, sk, bn):
            keys = np.arange(j0, min(sk, j0 + bn))
            kh, kl, ek = _split(kb[keys])
            vh, vl, ev = _split(vb[keys])
            dka = np.zeros((len(keys), d), F32)
            dva = np.zeros((len(keys), d), F32)
            for i0 in range(0, sq, bm):
                rows = np.arange(i0, min(sq, i0 + bm))
                ok = _visible(rows, keys, sq, sk, causal).T  # keys x rows
                if not ok.any():
                    continue
                qh, ql, eq = _split(qb[rows])
                dh, dl, ed = _split(dob[rows])
                st = _acc(np.zeros((len(keys), len(rows)), F32), kh, kl, qh.T, ql.T, 1.0)
                st = (st * np.ldexp(1.0, -(ek + eq))).astype(F32)
                with np.errstate(over="ignore", invalid="ignore"):
                    if "fma" in exact:  # (experiment) expf(fmaf(s, scale, -m))
                        x = (st.astype(np.float64) * float(F32(scale))
                             - m[rows][None, :]).astype(F32)
                    else:  # the kernel: expf(s * scale - m)
                        x = ((st * F32(scale)).astype(F32) - m[rows][None, :]).astype(F32)
                    if "div" in exact:  # (experiment) exp / l instead of exp * (1 / l)
                        p = (np.exp(x).astype(F32) / l[rows][None, :]).astype(F32)
                    else:
                        p = (np.exp(x).astype(F32) * linv[rows][None, :]).astype(F32)
                p = np.where(ok, p, F32(0))
                pp = (p.astype(np.float64) * 2.0 ** BWD_P16_LOG2).astype(F32)
                ph = pp.astype(np.float16).astype(np.float64)
                pl = (pp - ph.astype(F32)).astype(np.float16).astype(np.float64)
                if "p" in exact:  # (experiments) P's split without rounding
                    pl = pp.astype(np.float64) - ph
                dva = _acc(dva, ph, pl, dh, dl, np.ldexp(1.0, -(BWD_P16_LOG2 + ed)))
                dpt = _acc(np.zeros((len(keys), len(rows)), F32), vh, vl, dh.T, dl.T, 1.0)
                dpt = (dpt * np.ldexp(1.0, -(ev + ed))).astype(F32)
                pv = ((ph + pl) * p_unit).astype(F32)
                dst = np.where(pv == 0, F32(0),
                               (pv * (dpt - delta[rows][None, :]).astype(F32)).astype(F32))
                # split per 16 keys (a warp) and half tile (bm / 2 queries)
                e_lo, e_hi = -126 - min(eq, ek), 149 - max(eq, ek)
                dsh = np.zeros(dst.shape)
                dsl = np.zeros(dst.shape)
                eds = {}
                for w0 in range(0, len(keys), 16):
                    for hf in range(2):
                        c = slice(hf * bm // 2, (hf + 1) * bm // 2)
                        blk = dst[w0:w0 + 16, c]
                        if blk.size == 0:
                            continue
                        a = np.abs(blk[np.isfinite(blk)])
                        e = int(split16_exponent(a.max() if a.size else F32(0)))
                        e = min(max(e, e_lo), e_hi)
                        h, lo = split_fp16(blk, e)
                        if "ds" in exact:  # (experiments) dS's split without rounding
                            lo = blk.astype(np.float64) * 2.0 ** e - h
                        dsh[w0:w0 + 16, c], dsl[w0:w0 + 16, c] = h, lo
                        eds[(w0 // 16, hf)] = e
                nhalf = -(-len(rows) // (bm // 2))
                # dK += dS^T Q: k16 steps over the tile's queries (one half each when bm = 32)
                for w0 in range(0, len(keys), 16):
                    sl = slice(w0, w0 + 16)
                    fk = [np.ldexp(1.0, -(eds[(w0 // 16, (i * 16) // (bm // 2))] + eq))
                          for i in range(-(-len(rows) // 16))]
                    dka[sl] = _acc(dka[sl], dsh[sl], dsl[sl], qh, ql, fk)
                # dQ += dS K: k16 steps over the block's keys (warp kk), per m16 tile of rows
                for r0 in range(0, len(rows), 16):
                    rs = slice(r0, r0 + 16)
                    hf = (r0 // 16 * 16) // (bm // 2)
                    assert hf < max(nhalf, 1)
                    fq = [np.ldexp(1.0, -(eds[(kk, hf)] + ek))
                          for kk in range(-(-len(keys) // 16))]
                    acc = _acc(np.zeros((len(range(*rs.indices(len(rows)))), d), F32),
                               dsh[:, rs].T, dsl[:, rs].T, kh, kl, fq)
                    idx = rows[rs]
                    dqa[idx] = (dqa[idx] + acc).astype(F32)
            dk[b][keys] = (F32(scale) * dka).astype(F32)
            dv[b][keys] = dva
        dq[b] = (F32(scale) * dqa).astype(F32)
    return tuple(ref.round_to(x.astype(np.float64), "float32") for x in (dq, dk, dv))
