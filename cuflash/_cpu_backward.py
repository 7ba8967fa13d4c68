"""The NumPy path of :func:`cuflash.attention_backward`: the tiled backward recurrence on the CPU.

The forward's tiled recurrence run in reverse (see :mod:`cuflash.reference` for the math): with
``delta = rowsum(do * o)`` computed once, every key tile ``[j0, j1)`` recomputes its probabilities
from q, k and the forward's lse, ``P = exp(scale q k^T - lse)``, and then, for every (batch, query
row) at once::

    dv[j0:j1] = P^T do,   dP = do v^T,   dS = P * (dP - delta),
    dq += dS k,   dk[j0:j1] = dS^T q             (both times the scale at the end)

so the extra memory is one ``Sq x block_k`` tile per batch entry plus the float32 gradients;
no ``Sq x Sk`` matrix is formed. The only Python loop is over key tiles.

Precision follows the forward: float16, bfloat16 and float32 inputs work in float32, float64 in
float64. For float32 and float64 inputs each row's softmax max m and sum l are first recomputed
(one more sweep over the keys) and ``P = exp(S - m) / l`` as a softmax forms it: the forward's lse
is float32 for every dtype, and its absolute error would become a relative error of P. dq, summed over the tiles, is
accumulated with Kahan compensation. Gradients of broadcast inputs are summed over the axes they
were broadcast along, in the working precision, before the one rounding to the input dtype.
Rows that see no key (lse = -inf) contribute zero gradient, never NaN.
"""
from __future__ import annotations

from typing import Optional, Tuple

import numpy as np

from ._cpu import _acc_dtype, _compensated_add
from .reference import _sum_to_shape as _sum_to  # one broadcast-sum rule for both

__all__ = ["attention_backward_numpy"]


def _tiles(sq, sk, causal, block_k, variant=None):
    """(j0, j1, r0, r1, re) per key tile: rows r0..re-1 see some key of the tile; rows
    r0..r1-1 only part of it (the tile crosses the causal diagonal there; with a variant r1 = r0
    and the variant's visibility masks). Tiles no row sees are skipped."""
    off = sk - sq
    for j0 in range(0, sk, block_k):
        j1 = min(j0 + block_k, sk)
        r0 = max(0, j0 - off) if causal else 0
        re = sq
        if variant is not None:
            r0, re = variant.row_range(j0, j1, sq, sk, causal)
        if r0 >= re:
            continue
        r1 = min(sq, j1 - 1 - off) if causal and variant is None else r0
        yield j0, j1, r0, r1, re


def _variant_scores(s, variant, batch, r0, re, j0, j1, sq, sk, causal):
    """Apply the variant to a tile of scaled scores; returns (s, d score / d scaled score or
    None where it is 1)."""
    if variant is None:
        return s, None
    s = np.array(np.broadcast_to(s, tuple(batch) + s.shape[-2:]))
    add, vis = variant.tile(batch, None, r0, re, j0, j1, sq, sk, causal, s.dtype)
    with np.errstate(invalid="ignore", over="ignore"):
        dsc = variant.apply(s, add, vis, where=(batch, None, r0, j0))
    return s, dsc


def _mask_tile(s, j0, j1, r0, r1, off, fill):
    if r1 > r0:
        rows = np.arange(r0, r1)[:, None]
        cols = np.arange(j0, j1)[None, :]
        np.copyto(s[..., : r1 - r0, :], fill, where=cols > rows + off)


def _row_stats(q_acc, k, v, do_acc, *, causal, scale, block_k, batch, variant=None):
    """Each row's softmax max m, sum l = sum exp(s - m) and delta = sum_j p_j dP_j, in the
    working precision, by the forward's recurrence with dP = do v^T in place of v; m = -inf,
    l = 1, delta = 0 for rows that see no key."""
    acc = q_acc.dtype
    sq, sk = q_acc.shape[-2], k.shape[-2]
    m = np.full(batch + (sq,), -np.inf, dtype=acc)
    l = np.zeros(batch + (sq,), dtype=acc)
    dsum = np.zeros(batch + (sq,), dtype=acc)
    for j0, j1, r0, r1, re in _tiles(sq, sk, causal, block_k, variant):
        s = np.matmul(q_acc[..., r0:re, :], np.swapaxes(k[..., j0:j1, :].astype(acc), -1, -2))
        s *= acc.type(scale)
        s, _ = _variant_scores(s, variant, batch, r0, re, j0, j1, sq, sk, causal)
        _mask_tile(s, j0, j1, r0, r1, sk - sq, -np.inf)
        dp = np.matmul(do_acc[..., r0:re, :], np.swapaxes(v[..., j0:j1, :].astype(acc), -1, -2))
        m_old = m[..., r0:re]
        m_new = np.maximum(m_old, s.max(axis=-1))
        shift = np.where(m_new == -np.inf, acc.type(0), m_new)
        alpha = np.exp(m_old - shift)
        e = np.exp(s - shift[..., None])
        l[..., r0:re] = l[..., r0:re] * alpha + e.sum(axis=-1)
        dsum[..., r0:re] = (dsum[..., r0:re] * alpha
                            + np.where(e == 0, acc.type(0), e * dp).sum(axis=-1))
        m[..., r0:re] = m_new
    empty = l == 0
    l_safe = np.where(empty, acc.type(1), l)
    return (np.where(empty, -np.inf, m).astype(acc), l_safe.astype(acc),
            np.where(empty, acc.type(0), dsum / l_safe).astype(acc))


def attention_backward_numpy(do: np.ndarray, q: np.ndarray, k: np.ndarray, v: np.ndarray,
                             o: np.ndarray, lse: np.ndarray, *, causal: bool, scale: float,
                             out: Optional[Tuple[np.ndarray, np.ndarray, np.ndarray]] = None,
                             block_k: int = 128, variant=None, return_dbias: bool = False,
                             out_dbias: Optional[np.ndarray] = None) -> tuple:
    """Gradients of attention on NumPy arrays by the tiled backward recurrence.

    Parameters
    ----------
    do, o : ndarray, shape (batch..., Sq, Dv)
        The upstream gradient and the forward's output (full broadcast batch shape).
    q : ndarray, shape (..., Sq, D)
    k : ndarray, shape (..., Sk, D)
    v : ndarray, shape (..., Sk, Dv)
        One floating dtype, any strides, batch axes broadcasting (validated by
        ``cuflash._checks.check_backward``).
    lse : ndarray of float32, shape (batch..., Sq)
        The forward's log-sum-exp (natural log; -inf for rows that see no key).
    causal : bool
    scale : float
    out : (dq, dk, dv) or None
        Buffers of q's, k's and v's shapes and dtype; every element is written.
    block_k : int
        Keys per tile.
    variant : cuflash.variants.Variant, optional
        As in the forward (tiles the window does not reach are skipped whole; bias and mask
        are read one tile slice at a time).
    return_dbias : bool
        Also return dbias, the gradient of the final scores summed to the bias's shape
        (accumulated tile by tile in the working precision, into ``out_dbias`` when given).

    Returns
    -------
    dq, dk, dv : ndarray, the shapes and dtype of q, k and v (``out``'s buffers when given)
    dbias : ndarray, the shape and dtype of bias (only with ``return_dbias``)
    """
    if variant is not None and variant.is_plain:
        variant = None
    dtype = q.dtype
    acc = _acc_dtype(dtype)
    sq, sk = q.shape[-2], k.shape[-2]
    batch = tuple(np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2]))
    block_k = max(1, int(block_k))
    off = sk - sq
    zero = acc.type(0)

    q_acc = q.astype(acc)
    do_acc = np.broadcast_to(do, batch + do.shape[-2:]).astype(acc)
    delta = np.sum(do_acc * o.astype(acc), axis=-1)
    if dtype in (np.float32, np.float64):
        # p = exp(s - m) / l as a softmax forms it: exp(s - lse) with the forward's float32 lse
        # carries lse's absolute error (about |lse| float32 ulps) as a relative error of p. And
        # delta = sum_j p_j dP_j from those p, so that dS = P (dP - delta) cancels as the
        # softmax's own derivative does: rowsum(do * o) carries o's rounding into every dS.
        m, l, delta = _row_stats(q_acc, k, v, do_acc, causal=causal, scale=scale,
                                 block_k=block_k, batch=batch, variant=variant)
    else:
        m = np.broadcast_to(lse, batch + (sq,)).astype(acc)
        l = np.ones_like(m)
    empty = m == -np.inf
    shift = np.where(empty, zero, m)

    dq = np.zeros(batch + q.shape[-2:], dtype=acc)
    dq_comp = np.zeros_like(dq)
    dk = np.zeros(batch + k.shape[-2:], dtype=acc)
    dv = np.zeros(batch + v.shape[-2:], dtype=acc)
    dbias = None
    if return_dbias:
        if variant is None or variant.bias is None:
            raise ValueError("return_dbias=True needs bias=")
        dbias = np.zeros(variant.bias.shape, dtype=acc)
    for j0, j1, r0, r1, re in _tiles(sq, sk, causal, block_k, variant):
        kt = k[..., j0:j1, :].astype(acc)
        vt = v[..., j0:j1, :].astype(acc)
        s = np.matmul(q_acc[..., r0:re, :], np.swapaxes(kt, -1, -2))
        s *= acc.type(scale)
        s, dsc = _variant_scores(s, variant, batch, r0, re, j0, j1, sq, sk, causal)
        # Masked scores are -inf before the exp (as in the forward): exp(s - m) of a masked
        # score above the row's max would overflow (a RuntimeWarning) before being zeroed.
        _mask_tile(s, j0, j1, r0, r1, off, -np.inf)
        with np.errstate(invalid="ignore"):   # -inf - (-inf) on rows that see no key
            p = np.exp(s - shift[..., r0:re, None])
        p /= l[..., r0:re, None]
        p = np.where(empty[..., r0:re, None], zero, p)
        do_t = do_acc[..., r0:re, :]
        dv[..., j0:j1, :] = np.matmul(np.swapaxes(p, -1, -2), do_t)
        dp = np.matmul(do_t, np.swapaxes(vt, -1, -2))
        ds = p * (dp - delta[..., r0:re, None])
        # p = 0 exactly where masked or the row saw no key: no gradient there, even from inf.
        ds = np.where(p == 0, zero, ds)
        if dbias is not None:
            rs = slice(None) if dbias.shape[-2] == 1 else slice(r0, re)
            cs = slice(None) if dbias.shape[-1] == 1 else slice(j0, j1)
            dbias[..., rs, cs] += _sum_to(ds, dbias[..., rs, cs].shape)
        if dsc is not None:   # softcap's 1 - tanh^2, a score_mod's derivative
            ds = ds * dsc
        _compensated_add(dq[..., r0:re, :], dq_comp[..., r0:re, :], np.matmul(ds, kt))
        dk[..., j0:j1, :] = np.matmul(np.swapaxes(ds, -1, -2), q_acc[..., r0:re, :])
    dq *= acc.type(scale)
    dk *= acc.type(scale)

    results = []
    for i, (g, x) in enumerate(((dq, q), (dk, k), (dv, v))):
        g = _sum_to(g, x.shape)
        if out is not None:
            out[i][...] = g
            results.append(out[i])
        else:
            results.append(g.astype(dtype, copy=False))
    if dbias is not None:
        if out_dbias is not None:
            out_dbias[...] = dbias
            results.append(out_dbias)
        else:
            results.append(dbias.astype(variant.bias.dtype, copy=False))
    return tuple(results)
