"""The NumPy path of :func:`cuflash.attention`: the tiled online-softmax recurrence on the CPU.

The keys are visited in tiles of ``block_k``; each tile updates a running state ``(m, l, O)`` for
every (batch, query row) at once, exactly as a GPU thread block would for its rows (see
:mod:`cuflash.reference` for the recurrence).  The only Python loop is over key tiles.

Precision follows the kernels: float16 / float32 (and bfloat16, when ml_dtypes provides it)
inputs are upcast to float32 and the state is kept in float32; float64 inputs use float64
throughout.  The output has the input dtype and the log-sum-exp is float32.

Across tiles, ``l`` and ``O`` are summed with Kahan compensation, so the accumulated rounding
does not grow with the number of tiles (small ``block_k``, long sequences).

Rows that see no key (causal with ``Sq > Sk``) give ``o = 0`` and ``lse = -inf`` without NaN.
NaN and inf in the inputs are not sanitised: they propagate to the rows they reach (a NaN or
``+inf`` score makes its row NaN; a NaN in ``v`` reaches every row whose tile holds that key,
since a masked weight of 0 times NaN is NaN).  A row whose scores are all ``-inf`` is treated as
fully masked.
"""
from __future__ import annotations

from typing import Optional, Tuple

import numpy as np

__all__ = ["attention_numpy", "merge_states_numpy"]


def _acc_dtype(dtype: np.dtype) -> np.dtype:
    """Accumulation dtype: float64 for float64 inputs, float32 for everything narrower."""
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)


def attention_numpy(q: np.ndarray, k: np.ndarray, v: np.ndarray, *, causal: bool, scale: float,
                    out: Optional[np.ndarray], need_lse: bool,
                    block_k: int = 128) -> Tuple[np.ndarray, Optional[np.ndarray]]:
    """Exact attention on NumPy arrays by the tiled online-softmax recurrence.

    Parameters
    ----------
    q : ndarray, shape (..., Sq, D)
    k : ndarray, shape (..., Sk, D)
    v : ndarray, shape (..., Sk, Dv)
        One floating dtype (float16, float32, float64, or ml_dtypes' bfloat16), any strides.
        The batch axes broadcast (a key/value head axis of size 1 is multi-query attention).
        Already validated by ``cuflash._checks``.
    causal : bool
        Bottom-right aligned mask: query ``i`` sees key ``j`` iff ``j <= i + (Sk - Sq)``.
    scale : float
        Multiplies ``q . k``.
    out : ndarray or None
        If given, an array of the exact result shape and dtype; every element is written.
    need_lse : bool
        Whether to compute and return the log-sum-exp.
    block_k : int
        Keys per tile.

    Returns
    -------
    o : ndarray, shape (broadcast batch..., Sq, Dv), dtype of the inputs
        ``out`` itself when it was given.
    lse : ndarray of float32, shape (broadcast batch..., Sq), or None
        Natural log.  Fully masked rows give ``o = 0`` and ``lse = -inf``.  NaN/inf in the
        inputs propagate (nothing is sanitised).

    Notes
    -----
    For each key tile ``[j0, j1)`` only the query rows that see at least one of its keys are
    touched (with causal masking, rows ``i >= j0 - (Sk - Sq)``), and the element mask is
    applied only where the tile crosses the diagonal.  Rows skipped by every tile keep the
    empty state ``(-inf, 0, 0)``.  The running sums ``l`` and ``O`` are accumulated across
    tiles with Kahan compensation (still in the accumulation dtype), so the error does not grow
    with the number of tiles.
    """
    dtype = q.dtype
    acc = _acc_dtype(dtype)
    sq = q.shape[-2]
    sk, dv = k.shape[-2], v.shape[-1]
    batch = np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    block_k = max(1, int(block_k))
    off = sk - sq  # query i sees keys j <= i + off

    q_acc = q.astype(acc)  # contiguous working copy (one pass over q)
    scale_acc = acc.type(scale)
    zero = acc.type(0)

    # Running state per (batch, row), plus the compensation terms of l and O.
    m = np.full(batch + (sq,), -np.inf, dtype=acc)
    l = np.zeros(batch + (sq,), dtype=acc)
    o_acc = np.zeros(batch + (sq, dv), dtype=acc)
    l_comp = np.zeros_like(l)
    o_comp = np.zeros_like(o_acc)

    for j0 in range(0, sk, block_k):
        j1 = min(j0 + block_k, sk)
        # With causal masking, rows i < j0 - off see none of keys j0..j1-1: the tile lies
        # wholly above the diagonal for them, so they are not touched at all.
        r0 = max(0, j0 - off) if causal else 0
        if r0 >= sq:
            continue
        kt = k[..., j0:j1, :].astype(acc, copy=False)
        vt = v[..., j0:j1, :].astype(acc, copy=False)
        s = np.matmul(q_acc[..., r0:, :], np.swapaxes(kt, -1, -2))
        s *= scale_acc
        if causal:
            # Rows r0..r1-1 see only part of the tile (the tile crosses the diagonal there).
            r1 = min(sq, j1 - 1 - off)
            if r1 > r0:
                rows = np.arange(r0, r1)[:, None]
                cols = np.arange(j0, j1)[None, :]
                np.copyto(s[..., : r1 - r0, :], -np.inf, where=cols > rows + off)

        m_old = m[..., r0:]
        m_new = np.maximum(m_old, s.max(axis=-1))
        # Every touched row sees at least one key of the tile, so m_new is -inf only where the
        # inputs themselves gave -inf scores; shift by 0 there so exp yields 0, not NaN.
        shift = np.where(m_new == -np.inf, zero, m_new)
        alpha = np.exp(m_old - shift)
        p = np.exp(s - shift[..., None])

        l_rows, lc_rows = l[..., r0:], l_comp[..., r0:]
        o_rows, oc_rows = o_acc[..., r0:, :], o_comp[..., r0:, :]
        l_rows *= alpha
        lc_rows *= alpha
        o_rows *= alpha[..., None]
        oc_rows *= alpha[..., None]
        _compensated_add(l_rows, lc_rows, p.sum(axis=-1))
        _compensated_add(o_rows, oc_rows, np.matmul(p, vt))
        m[..., r0:] = m_new

    empty = m == -np.inf
    l_safe = np.where(empty, acc.type(1), l)
    o_acc /= l_safe[..., None]  # empty rows have O = 0, so they stay 0

    if out is not None:
        out[...] = o_acc
        o = out
    else:
        o = o_acc.astype(dtype, copy=False)

    lse = None
    if need_lse:
        lse = np.where(empty, -np.inf, m + np.log(l_safe)).astype(np.float32)
    return o, lse


def _compensated_add(total: np.ndarray, comp: np.ndarray, x: np.ndarray) -> None:
    """``total += x`` in place with Kahan compensation carried in ``comp``.

    Summing many tiles in a fixed precision loses about one rounding per tile; carrying the
    lost low-order part keeps the accumulated error at a few roundings however many tiles there
    are (this matters for small ``block_k`` or long sequences).  The compensation is reset
    where the running total is not finite, so inf/NaN inputs propagate as they would through a
    plain sum instead of turning into NaN via ``inf - inf``.
    """
    y = x - comp
    t = total + y
    with np.errstate(invalid="ignore"):  # inf - inf where the inputs carried inf
        np.subtract(t, total, out=comp)
        comp -= y
    np.copyto(comp, 0, where=~np.isfinite(t))
    total[...] = t


def merge_states_numpy(o_a: np.ndarray, lse_a: np.ndarray, o_b: np.ndarray,
                       lse_b: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """Merge two normalised attention results over disjoint key sets.

    Parameters
    ----------
    o_a, o_b : ndarray, shape (..., Sq, Dv)
        Partial outputs (same dtype); an empty part is ``o = 0``.
    lse_a, lse_b : ndarray, shape (..., Sq)
        Their log-sum-exps (natural log); an empty part is ``-inf``.

    Returns
    -------
    o : ndarray, shape (..., Sq, Dv), dtype of ``o_a``/``o_b``
        ``o_a exp(lse_a - lse) + o_b exp(lse_b - lse)``, computed in float32 (float64 for
        float64 outputs); 0 where both parts are empty.
    lse : ndarray of float32, shape (..., Sq)
        ``logaddexp(lse_a, lse_b)``; ``-inf`` where both parts are empty.  NaN propagates.
    """
    dtype = np.result_type(o_a.dtype, o_b.dtype)
    acc = _acc_dtype(dtype)
    la = np.asarray(lse_a).astype(acc)
    lb = np.asarray(lse_b).astype(acc)
    lse = np.logaddexp(la, lb)
    shift = np.where(lse == -np.inf, acc.type(0), lse)
    wa = np.exp(la - shift)
    wb = np.exp(lb - shift)
    o = o_a.astype(acc) * wa[..., None] + o_b.astype(acc) * wb[..., None]
    return o.astype(dtype, copy=False), lse.astype(np.float32)
