"""The NumPy path of :func:`cuflash.attention`: the tiled online-softmax recurrence on the CPU.

The (broadcast) batch is walked in chunks of heads small enough that a chunk's score tile stays
in the CPU caches (about 4 MiB); within a chunk the keys are visited in tiles of ``block_k``
(512 by default) and each tile updates a running state ``(m, l, O)`` for every (head, query row)
of the chunk at once, exactly as a GPU thread block would for its rows (see
:mod:`cuflash.reference` for the recurrence).  Extra memory is one score tile, the chunk's
working copies of q, k, v and the state: O(S), never ``Sq x Sk``.

Precision follows the kernels: float16 / float32 (and bfloat16, when ml_dtypes provides it)
inputs are upcast to float32 and the state is kept in float32; float64 inputs use float64
throughout; the matrix products go to BLAS in that precision.  The softmax scale multiplies each
tile of products ``q . k`` (one rounding, as the backward and a hand-written
``(q @ k^T) * scale`` round it).  A scale folded into q instead rounds every element of q: an
error of the same size but another pattern, which with scores in the hundreds (float32,
scale 2.5, inputs of standard deviation 3) dominates the output's error and put it above twice
the naive implementation's on about one draw in eight.  The output has the input dtype and the
log-sum-exp is float32.  When a row's keys span more than a few tiles (small ``block_k``, long sequences),
``l`` and ``O`` are summed across tiles with Kahan compensation, so the accumulated rounding does
not grow with the number of tiles.

Rows that see no key (causal with ``Sq > Sk``) give ``o = 0`` and ``lse = -inf`` without NaN.
NaN and inf in the inputs are not sanitised; they reach exactly the rows that see them, as in
the float64 reference: a NaN or ``+inf`` score makes its row NaN, a NaN in ``v`` makes its
column NaN in every row that sees that key, and a key that a row cannot see (masked) does not
touch that row.  A row whose scores are all ``-inf`` is treated as fully masked.
"""
from __future__ import annotations

from typing import Optional, Tuple

import numpy as np

__all__ = ["attention_numpy", "merge_states_numpy"]

#: Keys per tile by default.
BLOCK_K = 512
#: Score-tile elements a chunk of heads aims at (float32: 4 MiB, about an L2 or L3 slice).
TILE_ELEMS = 1 << 20
#: Kahan compensation across tiles pays only when a row's keys span more tiles than this.
KAHAN_MIN_TILES = 8


def _acc_dtype(dtype: np.dtype) -> np.dtype:
    """Accumulation dtype: float64 for float64 inputs, float32 for everything narrower."""
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)


def _gather(x: np.ndarray, batch, n0: int, n1: int, acc: np.dtype) -> np.ndarray:
    """Heads ``n0..n1-1`` of the flattened broadcast batch of ``x`` (..., S, D) as a contiguous
    (n1 - n0, S, D) array of ``acc``: a copy of that chunk only, also for broadcast inputs (a
    read-only view of ``x`` itself where no copy is needed)."""
    tail = x.shape[-2:]
    if not batch:
        chunk = x[None]
    elif x.shape[:-2] == tuple(batch):
        chunk = x.reshape((-1,) + tail)[n0:n1]   # a view unless the batch axes do not merge
    else:
        xb = np.broadcast_to(x, tuple(batch) + tail)
        chunk = xb[np.unravel_index(np.arange(n0, n1), batch)]
    return np.ascontiguousarray(chunk, dtype=acc)


def attention_numpy(q: np.ndarray, k: np.ndarray, v: np.ndarray, *, causal: bool, scale: float,
                    out: Optional[np.ndarray], need_lse: bool,
                    block_k: int = BLOCK_K, variant=None) -> Tuple[np.ndarray, Optional[np.ndarray]]:
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
        Keys per tile (default 512).
    variant : cuflash.variants.Variant, optional
        window / softcap / alibi / bias / mask (semantics in :mod:`cuflash.variants`). Each key
        tile touches only the rows its window reaches (tiles no row sees are skipped whole) and
        reads only its own slice of bias and mask.

    Returns
    -------
    o : ndarray, shape (broadcast batch..., Sq, Dv), dtype of the inputs
        ``out`` itself when it was given.
    lse : ndarray of float32, shape (broadcast batch..., Sq), or None
        Natural log.  Fully masked rows give ``o = 0`` and ``lse = -inf``.  NaN/inf in the
        inputs reach the rows that see them (nothing is sanitised; masked keys touch nothing).

    Notes
    -----
    For each key tile ``[j0, j1)`` only the query rows that see at least one of its keys are
    touched (with causal masking, rows ``i >= j0 - (Sk - Sq)``), and the element mask is
    applied only where the tile crosses the diagonal.  Rows skipped by every tile keep the
    empty state ``(-inf, 0, 0)``.  Extra memory: one score tile of about ``TILE_ELEMS``
    elements (at least one head's ``Sq x block_k``), the chunk's working copies and the
    float32 (float64) state and output.
    """
    dtype = q.dtype
    acc = _acc_dtype(dtype)
    sq, d = q.shape[-2:]
    sk, dv = k.shape[-2], v.shape[-1]
    batch = tuple(np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2]))
    n_heads = int(np.prod(batch)) if batch else 1
    block_k = max(1, min(int(block_k), sk))
    off = sk - sq  # query i sees keys j <= i + off
    n_tiles = -(-sk // block_k)
    kahan = n_tiles > KAHAN_MIN_TILES
    hb = max(1, min(n_heads, TILE_ELEMS // max(1, sq * block_k)))
    scale_acc = acc.type(scale)
    zero = acc.type(0)

    if variant is not None and variant.is_plain:
        variant = None
    o_all = np.empty((n_heads, sq, dv), dtype=acc)
    lse_all = np.empty((n_heads, sq), dtype=np.float32) if need_lse else None
    buf = np.empty(hb * sq * block_k, dtype=acc)       # the score tile, reused

    for n0 in range(0, n_heads, hb):
        n1 = min(n_heads, n0 + hb)
        qc = _gather(q, batch, n0, n1, acc)
        kc = _gather(k, batch, n0, n1, acc)
        vc = _gather(v, batch, n0, n1, acc)
        v_finite = bool(np.isfinite(vc).all()) if (causal or variant is not None) else True
        h = n1 - n0
        m = np.full((h, sq), -np.inf, dtype=acc)
        l = np.zeros((h, sq), dtype=acc)
        o_acc = np.zeros((h, sq, dv), dtype=acc)
        l_comp = np.zeros_like(l) if kahan else None
        o_comp = np.zeros_like(o_acc) if kahan else None

        for j0 in range(0, sk, block_k):
            j1 = min(j0 + block_k, sk)
            # With causal masking, rows i < j0 - off see none of keys j0..j1-1: the tile lies
            # wholly above the diagonal for them, so they are not touched at all.
            r0 = max(0, j0 - off) if causal else 0
            re = sq
            if variant is not None:   # the rows the window reaches (causal included)
                r0, re = variant.row_range(j0, j1, sq, sk, causal)
            if r0 >= re:
                continue
            rows = re - r0
            s = buf[: h * rows * (j1 - j0)].reshape(h, rows, j1 - j0)
            np.matmul(qc[:, r0:re, :], kc[:, j0:j1, :].swapaxes(-1, -2), out=s)
            with np.errstate(over="ignore", invalid="ignore"):   # inf inputs: as the reference
                np.multiply(s, scale_acc, out=s)
            r1 = min(sq, j1 - 1 - off) if causal else r0
            vis_t = None
            if variant is not None:
                add, vis_t = variant.tile(batch, (n0, n1), r0, re, j0, j1, sq, sk, causal, acc)
                with np.errstate(invalid="ignore", over="ignore"):
                    variant.apply(s, add, vis_t, where=(batch, (n0, n1), r0, j0), grad=False)
                r1 = r0   # the variant's visibility replaces the causal band below
            if r1 > r0:
                # Rows r0..r1-1 see only part of the tile (the tile crosses the diagonal there).
                band = np.arange(j0, j1)[None, :] > np.arange(r0, r1)[:, None] + off
                np.copyto(s[:, : r1 - r0, :], -np.inf, where=band)

            m_old = m[:, r0:re]
            m_new = np.maximum(m_old, s.max(axis=-1))
            # Every touched row sees at least one key of the tile, so m_new is -inf only where
            # the inputs themselves gave -inf scores; shift by 0 there so exp yields 0, not NaN.
            shift = np.where(m_new == -np.inf, zero, m_new)
            with np.errstate(invalid="ignore"):  # inf - inf where the inputs carried inf
                s -= shift[..., None]
                alpha = np.exp(m_old - shift)
            np.exp(s, out=s)
            m[:, r0:re] = m_new
            if vis_t is not None and not v_finite:
                from .reference import masked_matmul
                pv = masked_matmul(s, vc[:, j0:j1, :], vis_t).astype(acc, copy=False)
            elif r1 > r0 and not v_finite:
                # 0 * NaN from a masked key's value must not reach the rows that cannot see it.
                from .reference import masked_matmul
                vis = np.ones((rows, j1 - j0), dtype=bool)
                vis[: r1 - r0] = ~band
                pv = masked_matmul(s, vc[:, j0:j1, :], vis).astype(acc, copy=False)
            else:
                pv = np.matmul(s, vc[:, j0:j1, :])
            psum = s.sum(axis=-1)

            l_rows, o_rows = l[:, r0:re], o_acc[:, r0:re, :]
            rescale = not bool(np.all(alpha == 1))
            if kahan:
                lc_rows, oc_rows = l_comp[:, r0:re], o_comp[:, r0:re, :]
                if rescale:
                    l_rows *= alpha
                    lc_rows *= alpha
                    o_rows *= alpha[..., None]
                    oc_rows *= alpha[..., None]
                _compensated_add(l_rows, lc_rows, psum)
                _compensated_add(o_rows, oc_rows, pv)
            else:
                if rescale:
                    l_rows *= alpha
                    o_rows *= alpha[..., None]
                l_rows += psum
                o_rows += pv

        empty = m == -np.inf
        l_safe = np.where(empty, acc.type(1), l)
        o_acc /= l_safe[..., None]  # empty rows have O = 0, so they stay 0
        o_all[n0:n1] = o_acc
        if need_lse:
            lse_all[n0:n1] = np.where(empty, -np.inf, m + np.log(l_safe))

    o_all = o_all.reshape(batch + (sq, dv))
    if out is not None:
        out[...] = o_all
        o = out
    else:
        o = o_all.astype(dtype, copy=False)
    lse = lse_all.reshape(batch + (sq,)) if need_lse else None
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
        ``o_a w_a + o_b w_b`` with ``w_a = e_a / (e_a + e_b)``, ``e_a = exp(lse_a - m)``,
        ``m = max(lse_a, lse_b)`` (as the GPU merge kernel forms them), computed in float32
        (float64 for float64 outputs); 0 where both parts are empty.  The weights depend on
        ``lse_a - lse_b`` only and sum to 1 up to rounding: weights taken as
        ``exp(lse_a - logaddexp(lse_a, lse_b))`` would carry the rounding of the merged lse,
        a relative error of about ``u |lse|`` in every output (5e-4 at ``|lse| = 1e4`` in
        float32).
    lse : ndarray of float32, shape (..., Sq)
        ``m + log(e_a + e_b)``; ``-inf`` where both parts are empty.  NaN propagates.
    """
    dtype = np.result_type(o_a.dtype, o_b.dtype)
    acc = _acc_dtype(dtype)
    la = np.asarray(lse_a).astype(acc)
    lb = np.asarray(lse_b).astype(acc)
    mx = np.maximum(la, lb)
    empty = mx == -np.inf
    shift = np.where(empty, acc.type(0), mx)
    with np.errstate(invalid="ignore"):   # inf - inf where a part's lse is +inf: NaN, as it should
        ea = np.exp(la - shift)
        eb = np.exp(lb - shift)
    tot = ea + eb
    tot_safe = np.where(empty, acc.type(1), tot)
    wa = ea / tot_safe
    wb = eb / tot_safe
    with np.errstate(divide="ignore"):
        lse = np.where(empty, acc.type(-np.inf), shift + np.log(tot_safe))
    o = o_a.astype(acc) * wa[..., None] + o_b.astype(acc) * wb[..., None]
    return o.astype(dtype, copy=False), lse.astype(np.float32)
