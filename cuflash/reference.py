"""Reference implementations: the float64 truth, the online-softmax recurrence, and the merge rule.

Everything here runs on NumPy/SciPy only and is meant for checking the kernels, not for speed.

Attention
---------
For one query row with scores ``s_j = scale * (q . k_j)`` the output is
``o = sum_j softmax(s)_j v_j`` and the log-sum-exp is ``lse = log sum_j exp(s_j)`` (natural log).
:func:`attention_ref` computes both in float64 with :func:`scipy.special.softmax` and
:func:`scipy.special.logsumexp`.

The recurrence
--------------
A tiled kernel never holds a whole score row.  It keeps, per query row, a running state
``(m, l, O)``: the largest score seen so far, the sum of ``exp(s - m)`` over the scores seen, and
the matching unnormalised output ``sum exp(s - m) v`` (a vector of length Dv).  The state starts
at ``(-inf, 0, 0)``.  A new chunk of scores ``s_c`` with values ``V_c`` is folded in by::

    m_new = max(m, max(s_c))
    alpha = exp(m - m_new)              # <= 1: rescales what was accumulated against the old max
    p     = exp(s_c - m_new)            # every exponent is <= 0, so nothing overflows
    l     = alpha * l + sum(p)
    O     = alpha * O + p @ V_c
    m     = m_new

After the last chunk the division happens once: ``o = O / l`` and ``lse = m + log(l)``.  After any
set of chunks the state satisfies ``m = max(s_seen)``, ``l = sum exp(s_seen - m)`` and
``O = sum exp(s_seen - m) v_seen``, so the result does not depend on the chunk sizes or on the
order in which the chunks arrive.  A row that has seen only ``-inf`` scores (a fully masked row)
keeps ``m = -inf``; the update must then avoid ``exp(-inf - (-inf))`` (NaN), and such a row
finalises to ``o = 0``, ``lse = -inf``.

The merge operator
------------------
Two states built from disjoint key sets combine into the state of their union::

    m = max(m_a, m_b)
    l = l_a exp(m_a - m) + l_b exp(m_b - m)
    O = O_a exp(m_a - m) + O_b exp(m_b - m)

and, for finalised results,
``lse = logaddexp(lse_a, lse_b)``, ``o = o_a exp(lse_a - lse) + o_b exp(lse_b - lse)``.
Writing a state as ``(e^m l, e^m O)`` turns the merge into plain addition, which is why it is
associative and commutative with identity ``(-inf, 0, 0)`` (the identity needs the same ``-inf``
guard as the update).  Split-K decoding and multi-device attention rely on it.

Tolerances
----------
:func:`naive_attention` is what a user gets by writing matmul -> softmax -> matmul by hand in a
given precision; its error against the float64 truth sets the relative bar a fused kernel must
meet, see :func:`tolerance`.  :func:`error_bound` is an a-priori forward-error bound from a
correct kernel's own arithmetic, which no broken naive implementation can inflate (derived in
``notes/ERROR_BOUND.md``).  :func:`pass_threshold` holds both as a :class:`PassRule`, whose
:meth:`PassRule.judge` passes a result only under both: the project's one pass rule.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import functools

import numpy as np
from scipy.special import logsumexp, softmax

from . import _gqa

__all__ = [
    "attention_ref",
    "naive_attention",
    "round_to",
    "round_to_tf32",
    "tolerance",
    "naive_error",
    "output_scale",
    "pass_threshold",
    "MIN_KEY_TILE",
    "NAIVE_INFORMATIVE_FRACTION",
    "naive_error_bound_f64",
    "unit_roundoff",
    "error_bound",
    "PassRule",
    "Verdict",
    "masked_matmul",
    "OnlineState",
    "init_state",
    "update",
    "finalize",
    "merge_state",
    "online_softmax",
    "merge_normalized",
    "unstable_softmax",
    "gather_kv_cache",
    "attention_with_kvcache_ref",
    "attention_varlen_ref",
]

_UNIT_ROUNDOFF = {
    "float16": 2.0 ** -11,
    "bfloat16": 2.0 ** -8,
    "float32": 2.0 ** -24,
    "float64": 2.0 ** -53,
}


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------

def _dtype_name(dtype) -> str:
    """Normalise a dtype given as a string, NumPy dtype, scalar type or ml_dtypes type to its name."""
    if isinstance(dtype, str):
        name = dtype
    else:
        try:
            name = np.dtype(dtype).name
        except TypeError:
            name = getattr(dtype, "__name__", str(dtype))
    if name not in _UNIT_ROUNDOFF:
        raise ValueError(
            f"unsupported dtype {dtype!r}; expected one of {sorted(_UNIT_ROUNDOFF)}"
        )
    return name


def unit_roundoff(dtype) -> float:
    """Unit roundoff ``u`` of ``dtype`` (half the distance from 1 to the next representable number).

    2^-11 for float16, 2^-8 for bfloat16, 2^-24 for float32, 2^-53 for float64.
    """
    return _UNIT_ROUNDOFF[_dtype_name(dtype)]


def _grouped_heads(results):
    """Decorator: accept grouped-query heads (q with H heads, k/v with Hkv dividing H on axis -3;
    query head h uses kv head h // (H / Hkv)) in a function written for broadcast batch axes.

    The head axes are split into (Hkv, g) views (`cuflash._gqa`), under which the grouping is
    a plain broadcast, and the results are put back into the caller's shapes: ``results`` is
    "o" (one output-shaped array), "o_lse" (a pair), "grads" (dq, dk, dv, first argument do)
    or "bwd_scalars" (first argument do, results that need no reshaping)."""
    def wrap(fn):
        @functools.wraps(fn)
        def inner(*args, **kwargs):
            first = 1 if results in ("grads", "bwd_scalars") else 0
            arrs = [np.asarray(a) for a in args[first:first + 3]]
            g, q, k, v = _gqa.split_all(*arrs)
            if g is None:
                return fn(*args, **kwargs)
            if kwargs.get("score_mod") is not None or kwargs.get("mask_mod") is not None:
                # the split would renumber the heads the hooks see (as cuflash.attention, refuse)
                raise ValueError("grouped-query heads cannot be combined with score_mod/mask_mod "
                                 "yet; repeat k and v to q's head count")
            lead = (g.split(np.asarray(args[0])),) if first else ()
            out = fn(*lead, q, k, v, *args[first + 3:], **kwargs)
            if results == "bwd_scalars":
                return out
            if results == "o":
                return g.merge(out)
            if results == "o_lse":
                return g.merge(out[0]), g.merge(out[1], -2)
            return tuple(x.reshape(a.shape) for x, a in zip(out, arrs))
        return inner
    return wrap


def _causal_mask(sq: int, sk: int) -> np.ndarray:
    """Boolean (sq, sk) array, True where query i may see key j (bottom-right aligned: j <= i + sk - sq)."""
    i = np.arange(sq)[:, None]
    j = np.arange(sk)[None, :]
    return j <= i + (sk - sq)


def _variant(variant, q=None, k=None, v=None):
    """The `cuflash.variants.Variant` of a reference call's ``**variant`` keyword arguments
    (``window``, ``softcap``, ``alibi_slopes``, ``bias``, ``mask``: as in `cuflash.attention`)."""
    from .variants import variant_of
    return variant_of(variant, q, k, v)


def _variant_batch(batch, var):
    """``batch`` broadcast with the batch axes of the variant's arrays."""
    shapes = [tuple(batch)]
    for x in (var.bias, var.mask):
        if x is not None:
            shapes.append(tuple(x.shape[:-2]))
    if var.alibi_slopes is not None:
        shapes.append(tuple(var.alibi_slopes.shape))
    if var.has_mods:   # user hooks count b and h in the inputs' whole batch
        shapes.append(tuple(var.mod_batch))
    return tuple(np.broadcast_shapes(*shapes))


def _variant_scores_f64(q, k, scale, causal, var):
    """float64 final scores of a variant, ``(s, dscore, visible, add)``: ``s`` with the
    invisible entries -inf (shape batch + (Sq, Sk), the batch widened by the variant's arrays),
    ``dscore`` the derivative of the final score with respect to the scaled score (softcap's
    ``1 - tanh^2(t / c)`` times a score_mod's; None where 1), ``visible`` bool broadcastable to
    ``s`` (None: all) and ``add`` the alibi + bias term (None when absent)."""
    s, add, vis = _variant_terms(_scores_f64(q, k, scale, False), var, causal)
    with np.errstate(invalid="ignore", over="ignore"):
        dsc = var.apply(s, add, vis, where=(s.shape[:-2], None, 0, 0))
    return s, dsc, vis, add


def _variant_terms(s, var, causal):
    """A writable copy of scores ``s`` widened to the variant's batch, the variant's additive
    term (float64) and the visibility (causal included; None: all visible)."""
    sq, sk = s.shape[-2:]
    batch = _variant_batch(s.shape[:-2], var)
    s = np.array(np.broadcast_to(s, batch + (sq, sk)))
    add, vis = var.tile(batch, None, 0, sq, 0, sk, sq, sk, causal, np.float64)
    if vis is None and causal:
        vis = _causal_mask(sq, sk)
    return s, add, vis


def _scores_f64(q, k, scale, causal, var=None):
    """float64 scores ``scale * q @ k^T`` with masked entries set to -inf, batch axes broadcast
    (with a non-plain variant ``var``: its final scores, see `_variant_scores_f64`)."""
    if var is not None and not var.is_plain:
        return _variant_scores_f64(q, k, scale, causal, var)[0]
    q = np.asarray(q, dtype=np.float64)
    k = np.asarray(k, dtype=np.float64)
    if q.ndim < 2 or k.ndim < 2:
        raise ValueError("q and k need at least 2 dimensions (..., S, D)")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"head dims differ: q has D={q.shape[-1]}, k has D={k.shape[-1]}")
    d = q.shape[-1]
    if scale is None:
        scale = 1.0 / math.sqrt(d) if d > 0 else 1.0
    with np.errstate(invalid="ignore", over="ignore"):  # inf inputs: 0 * inf, inf - inf
        s = np.matmul(q, np.swapaxes(k, -1, -2)) * float(scale)
    if causal:
        s = np.where(_causal_mask(s.shape[-2], s.shape[-1]), s, -np.inf)
    return s


# ---------------------------------------------------------------------------------------------
# float64 truth
# ---------------------------------------------------------------------------------------------

@_grouped_heads("o_lse")
def attention_ref(q, k, v, *, causal: bool = False, scale: Optional[float] = None, **variant):
    """Attention and log-sum-exp in float64 (SciPy softmax / logsumexp): the ground truth.

    Parameters
    ----------
    q : array_like, shape (..., Sq, D)
    k : array_like, shape (..., Sk, D)
    v : array_like, shape (..., Sk, Dv)
        Any real dtype; converted to float64.  The batch axes ``...`` broadcast NumPy-style, so a
        key/value head axis of size 1 gives multi-query attention.  2-D inputs (no batch axes)
        are accepted.
    causal : bool
        Bottom-right aligned causal mask: query ``i`` sees key ``j`` iff ``j <= i + (Sk - Sq)``.
    scale : float, optional
        Score scale, default ``1 / sqrt(D)``.
    window, softcap, alibi_slopes, bias, mask, score_mod, mask_mod, mod_args : optional
        An attention variant, as in `cuflash.attention` (semantics: :mod:`cuflash.variants`,
        user hooks: :mod:`cuflash.mods`, whose NumPy callables the references evaluate in
        float64); every reference and pass-rule function of this module takes them.

    Returns
    -------
    o : ndarray, float64, shape (broadcast batch..., Sq, Dv)
    lse : ndarray, float64, shape (broadcast batch..., Sq)
        Natural-log log-sum-exp of the scaled, masked scores.  Rows that see no key (possible
        when ``causal`` and ``Sq > Sk``) give ``o = 0`` and ``lse = -inf``, without NaN or warnings;
        so does a row whose scores are all ``-inf``.  NaN and inf in the inputs reach exactly
        the rows that see them: a key a row cannot see (masked) does not touch that row, whatever
        its values.  Within the visible keys they propagate as SciPy's softmax and a float64
        product propagate them (a NaN or ``+inf`` score makes its row NaN; a NaN in ``v`` makes
        the column NaN in every row that sees that key; an inf in ``v`` makes it inf, or NaN
        where it meets an inf of the other sign or a weight that underflowed to 0).
    """
    var = _variant(variant, q, k, v)
    v = np.asarray(v, dtype=np.float64)
    s = _scores_f64(q, k, scale, causal, var)
    if v.ndim < 2 or v.shape[-2] != s.shape[-1]:
        raise ValueError(f"v must have shape (..., Sk={s.shape[-1]}, Dv); got {v.shape}")
    batch = np.broadcast_shapes(s.shape[:-2], v.shape[:-2])
    s = np.broadcast_to(s, batch + s.shape[-2:])
    dv = v.shape[-1]

    if s.shape[-1] == 0:
        return np.zeros(batch + (s.shape[-2], dv)), np.full(batch + (s.shape[-2],), -np.inf)
    empty = np.all(s == -np.inf, axis=-1)  # rows with no visible key
    # Give empty rows harmless finite scores, then overwrite their results.
    s_safe = np.where(empty[..., None], 0.0, s)
    with np.errstate(invalid="ignore"):
        p = softmax(s_safe, axis=-1)
        lse = logsumexp(s_safe, axis=-1)
    p = np.where(empty[..., None], 0.0, p)
    lse = np.where(empty, -np.inf, lse)
    visible = _visible_f64(s.shape[-2], s.shape[-1], causal, var)
    o = masked_matmul(p, v, visible)
    return o, lse


def _visible_f64(sq, sk, causal, var):
    """Bool visibility broadcastable to (batch..., Sq, Sk), or None when every key is visible."""
    if var is not None and not var.is_plain:
        _, vis = var.tile(_variant_batch((), var), None, 0, sq, 0, sk, sq, sk, causal,
                          np.float64)
        if vis is not None:
            return vis
    return _causal_mask(sq, sk) if causal else None


def masked_matmul(p, v, visible=None):
    """``p @ v`` in which a key that a row cannot see never touches that row.

    Parameters
    ----------
    p : ndarray, shape (..., Sq, Sk)
        Weights, 0 at masked positions.
    v : ndarray, shape (..., Sk, Dv)
    visible : ndarray of bool, shape (Sq, Sk) or broadcastable to (..., Sq, Sk), optional
        True where row i may see key j; None: every key is visible (then this is ``p @ v``).

    Returns
    -------
    ndarray, shape (broadcast batch..., Sq, Dv)
        A plain matmul would add ``0 * NaN = NaN`` (and ``0 * inf``) from a masked key's value
        to every row; here the non-finite values of ``v`` are left out of the product and added
        back, as ``p_ij * v_jc``, only to the rows that see key j. A visible key's NaN or inf
        still reaches its row as in a plain product (a visible weight that underflowed to 0
        times inf is NaN, as in float64 arithmetic).
    """
    bad = ~np.isfinite(v)
    if visible is None or not bad.any():
        return np.matmul(p, v)
    o = np.matmul(p, np.where(bad, 0.0, v))
    keys = np.flatnonzero(bad.reshape(-1, *bad.shape[-2:]).any(axis=(0, 2)))
    for c0 in range(0, keys.size, 32):  # bounded temporaries: (..., Sq, 32, Dv)
        j = keys[c0:c0 + 32]
        pj = p[..., :, j, None]                       # (..., Sq, J, 1)
        vj = v[..., None, j, :]                       # (..., 1, J, Dv)
        take = visible[..., :, j, None] & bad[..., None, j, :]
        with np.errstate(invalid="ignore"):
            o = o + np.where(take, pj * vj, 0.0).sum(axis=-2)
    return o


# ---------------------------------------------------------------------------------------------
# rounding, naive same-precision attention, tolerance
# ---------------------------------------------------------------------------------------------

def _float64_to_float32_odd(x: np.ndarray) -> np.ndarray:
    """float64 -> float32 with round-to-odd.

    Rounding to odd first and then to nearest-even at a precision at least two bits lower gives
    the correctly rounded result (no double-rounding error), which a plain float64 -> float32
    -> bfloat16 chain does not guarantee.
    """
    with np.errstate(over="ignore", invalid="ignore"):
        y = x.astype(np.float32)
        inexact = (y.astype(np.float64) != x) & np.isfinite(x)
        # Truncate toward zero: step back one ulp where nearest rounding went away from zero.
        away = np.abs(y.astype(np.float64)) > np.abs(x)
        y = np.where(inexact & away, np.nextafter(y, np.float32(0)), y)
    bits = y.view(np.uint32)
    bits = np.where(inexact, bits | np.uint32(1), bits)
    return bits.astype(np.uint32).view(np.float32)


def round_to(x, dtype) -> np.ndarray:
    """Round float64 values to the nearest value representable in ``dtype`` (ties to even).

    Parameters
    ----------
    x : array_like
        Values, converted to float64.
    dtype : {"float16", "bfloat16", "float32", "float64"} or a matching dtype object

    Returns
    -------
    ndarray, float64, same shape as ``x``
        Values representable in ``dtype``.  Out-of-range magnitudes become ``inf``; ``inf`` and
        ``nan`` are kept.  bfloat16 (8 exponent bits, 7 stored mantissa bits, the top half of a
        float32) is done with integer operations on the float32 bit pattern, so ml_dtypes is not
        needed.
    """
    name = _dtype_name(dtype)
    x = np.asarray(x, dtype=np.float64)
    if name == "float64":
        return x.copy()
    if name == "float16":
        with np.errstate(over="ignore"):
            return x.astype(np.float16).astype(np.float64)
    if name == "float32":
        with np.errstate(over="ignore"):
            return x.astype(np.float32).astype(np.float64)
    # bfloat16
    y = _float64_to_float32_odd(np.atleast_1d(x))
    u = y.view(np.uint32).astype(np.uint64)
    lsb = (u >> np.uint64(16)) & np.uint64(1)
    r = ((u + np.uint64(0x7FFF) + lsb) & np.uint64(0xFFFF0000)).astype(np.uint32)
    out = r.view(np.float32).astype(np.float64)
    out = np.where(np.isnan(x.reshape(out.shape)), np.nan, out)
    return out.reshape(x.shape)


def round_to_tf32(x) -> np.ndarray:
    """Round float64 values to TF32 (10 explicit mantissa bits, float32's exponent range), ties
    away from zero, as ``cvt.rna.tf32.f32`` does on float32 values: float64 -> float32 (nearest)
    first, then to 11 significant bits."""
    x32 = np.asarray(x, dtype=np.float64).astype(np.float32)
    bits = x32.view(np.uint32).astype(np.uint64)
    finite = np.isfinite(x32)
    r = ((bits + np.uint64(0x1000)) & np.uint64(0xFFFFE000)).astype(np.uint32)
    out = np.where(finite, r.view(np.float32), x32)
    return out.astype(np.float64)


@_grouped_heads("o")
def naive_attention(q, k, v, *, causal: bool = False, scale: Optional[float] = None, dtype,
                    precision: Optional[str] = None, **variant):
    """Unfused attention computed the way a user would write it by hand in ``dtype``.

    ``S = scale * q @ k^T`` -> ``P = softmax(S)`` -> ``O = P @ V``, with every product
    accumulated in float32 and the result of each stage rounded to ``dtype`` (float16, bfloat16
    or float32).  The softmax itself runs in float32 on the rounded scores (max-subtracted).  For
    ``dtype="float64"`` the same unfused steps run in float64 (so the result differs from
    :func:`attention_ref` only by float64 rounding).

    Parameters
    ----------
    q : array_like, shape (..., Sq, D)
    k : array_like, shape (..., Sk, D)
    v : array_like, shape (..., Sk, Dv)
        float64 arrays (or anything convertible) that already hold values representable in
        ``dtype``; batch axes broadcast.
    causal, scale
        As in :func:`attention_ref`.  Masked scores are ``-inf``; rows with no visible key
        give 0.
    dtype : {"float16", "bfloat16", "float32", "float64"}
    precision : {None, "highest", "high"}, optional
        float32 only: ``"high"`` rounds the operands of both products to TF32 (what a one-pass
        TF32 matmul does: :func:`round_to_tf32`), the naive counterpart of
        ``cuflash.attention(..., precision="high")``; None and "highest" leave them in float32.

    Returns
    -------
    ndarray, float64, shape (broadcast batch..., Sq, Dv)
        Values representable in ``dtype``.
    """
    name = _dtype_name(dtype)
    tf32 = precision == "high" and name == "float32"
    if precision not in (None, "default", "highest", "high"):
        raise ValueError(f"precision must be None, 'highest' or 'high', got {precision!r}")
    # Working precision of every stage: float32 for the narrow types, float64 for float64.
    wd = np.float64 if name == "float64" else np.float32

    def rnd(x):
        """Round a stage's result to ``dtype`` (identity for float32 / float64)."""
        if name in ("float32", "float64"):
            return x
        return round_to(x.astype(np.float64), name).astype(wd)

    qw = np.asarray(q, dtype=np.float64).astype(wd)
    kw = np.asarray(k, dtype=np.float64).astype(wd)
    vw = np.asarray(v, dtype=np.float64).astype(wd)
    d = qw.shape[-1]
    if scale is None:
        scale = 1.0 / math.sqrt(d) if d > 0 else 1.0

    def op(x):
        """An operand of a product: rounded to TF32 in the "high" mode."""
        return round_to_tf32(x).astype(wd) if tf32 else x

    s = rnd(np.matmul(op(qw), np.swapaxes(op(kw), -1, -2)) * wd(scale))
    var = _variant(variant, q, k, v)
    vis_all = _causal_mask(s.shape[-2], s.shape[-1]) if causal else None
    if not var.is_plain:
        s, vis_all = _naive_variant_scores(s, var, causal, rnd)
    elif causal:
        s = np.where(_causal_mask(s.shape[-2], s.shape[-1]), s, wd(-np.inf))
    if s.shape[-1] == 0:
        batch = np.broadcast_shapes(s.shape[:-2], vw.shape[:-2])
        return np.zeros(batch + (s.shape[-2], vw.shape[-1]))

    # Max-subtracted softmax in the working precision; fully masked rows give P = 0.
    m = np.max(s, axis=-1, keepdims=True)
    empty = m == -np.inf
    m = np.where(empty, wd(0), m)
    e = np.exp(s - m)
    den = np.sum(e, axis=-1, keepdims=True, dtype=wd)
    den = np.where(empty, wd(1), den)
    p = rnd(e / den)

    o = rnd(masked_matmul(op(p), op(vw), vis_all))
    return np.asarray(o, dtype=np.float64)


def _naive_variant_scores(s, var, causal, rnd, want_tanh=False):
    """The variant's steps on rounded scores ``s`` as a hand-written implementation takes them
    in its working precision: softcap (the tanh and the product each rounded), the additive
    term (rounded to the dtype first, as a bias tensor of that dtype would be), the mask.
    A score_mod runs on the result in the working precision, its value and derivative each
    rounded. Returns ``(s, visible)`` (and with ``want_tanh`` the derivative of the final
    score by the scaled score, ``1 - th^2`` of the rounded tanh ``th`` times the rounded
    score_mod derivative, or None where 1)."""
    wd = s.dtype.type
    s, add, vis = _variant_terms(s, var, causal)
    dsc = None
    with np.errstate(invalid="ignore", over="ignore"):
        if var.softcap:
            c = wd(var.softcap)
            th = rnd(np.tanh(s / c))
            s = rnd(th * c)
            dsc = wd(1) - th * th
        if add is not None:
            s = rnd(s + rnd(add.astype(s.dtype)))
        if var.score_mod is not None:
            b, h, qi, kj = var.mod_index(s.shape[:-2], None, 0, s.shape[-2], 0, s.shape[-1])
            args = var._args()
            if want_tanh:
                var.need_grad()
                g = rnd(var.score_mod.derivative(s, b, h, qi, kj, args))
                dsc = g if dsc is None else dsc * g
            s = rnd(var.score_mod.evaluate(s, b, h, qi, kj, args))
    if vis is not None:
        s = np.where(vis, s, wd(-np.inf))
        if dsc is not None and var.has_mods:
            dsc = np.where(vis, dsc, wd(0))
    return (s, vis, dsc) if want_tanh else (s, vis)


def naive_error_bound_f64(q, k, v, *, scale=None) -> float:
    """A priori bound on the max abs error of a float64 matmul -> softmax -> matmul.

    For float64 inputs the "naive same-precision implementation" is the float64 reference
    itself, so its error cannot be measured against it. This standard forward-error bound stands
    in for it: the scores carry at most ``(D + 1) u |scale| |q| |k|`` absolute error, which moves
    each softmax weight by at most twice that relative amount, and the weighted sum over Sk keys
    adds ``Sk u max|v|`` more::

        u * max|v| * (2 (D + 1) |scale| max|q_i| max|k_j| + 2 Sk + 4)

    with u = 2^-53 and |q_i|, |k_j| the Euclidean norms of the rows.
    """
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    d, sk = q.shape[-1], k.shape[-2]
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    def fmax(x):  # the largest finite value: NaN/inf inputs are judged by position instead
        x = x[np.isfinite(x)]
        return float(np.max(x)) if x.size else 0.0

    with np.errstate(invalid="ignore", over="ignore"):
        qn = fmax(np.sqrt(np.sum(q * q, axis=-1)))
        kn = fmax(np.sqrt(np.sum(k * k, axis=-1)))
        vmax = fmax(np.abs(v))
    u = unit_roundoff("float64")
    return u * vmax * (2.0 * (d + 1) * abs(float(scale)) * qn * kn + 2.0 * sk + 4.0)


def naive_error(q, k, v, *, causal=False, scale=None, dtype, o_ref=None,
                precision=None, **variant) -> float:
    """The max abs error, against the float64 reference, of the naive implementation in `dtype`.

    Measured (``naive_attention`` vs ``attention_ref``) for float16, bfloat16 and float32; for
    float64, where the reference is itself the naive float64 computation, the bound of
    :func:`naive_error_bound_f64`. NaN/inf entries of the reference are left out.
    """
    if _dtype_name(dtype) == "float64":
        return naive_error_bound_f64(q, k, v, scale=scale) + _variant_f64_extra(q, k, v, variant,
                                                                                scale)
    if o_ref is None:
        o_ref, _ = attention_ref(q, k, v, causal=causal, scale=scale, **variant)
    with np.errstate(invalid="ignore", over="ignore"):
        diff = np.abs(naive_attention(q, k, v, causal=causal, scale=scale, dtype=dtype,
                                      precision=precision, **variant) - o_ref)
    diff = diff[np.isfinite(diff)]
    return float(diff.max()) if diff.size else 0.0


NO_BOUND = ("a score_mod without lipschitz= has no a-priori error bound (its derivative could "
            "amplify the score's error without limit): declare ScoreMod(..., lipschitz=L) with "
            "L >= |d score_mod / d score| to get one; without it only the measured 2x-naive rule "
            "judges, and float64 (whose naive error is itself a bound) cannot be judged")


def _hook_lipschitz(var):
    """The score_mod's declared Lipschitz constant (1 without a score_mod); ValueError when a
    score_mod declares none."""
    if var.score_mod is None:
        return 1.0
    if var.score_mod.lipschitz is None:
        raise ValueError(NO_BOUND)
    return var.score_mod.lipschitz


def _variant_f64_extra(q, k, v, variant, scale=None):
    """What a variant adds to the float64 naive bounds: the roundings of the additive term and
    of the softcap, ``u * max|v| * (4 max|a| + 8 c)``, ``a`` the alibi + bias term. A score_mod
    with Lipschitz constant ``L`` adds ``u * max|v| * ((L - 1)+ (2 (D + 1) |scale| max|q_i|
    max|k_j| + 4 max|a| + 8 c) + 16 max|f|)``: the scores' errors amplified by ``L`` and its
    own evaluation (a few roundings at the size ``max|f|`` of its visible results)."""
    var = _variant(variant, q, k, v)
    if var.is_plain:
        return 0.0
    if var.score_mod is not None:
        lip = _hook_lipschitz(var)
        base = _variant_f64_extra(q, k, v, var.builtin())
        q64, k64 = np.asarray(q, dtype=np.float64), np.asarray(k, dtype=np.float64)
        sc = _scale_or_default(scale, q64.shape[-1])
        with np.errstate(invalid="ignore", over="ignore"):
            fin = _variant_scores_f64(q64, k64, sc, False, var)[0]
            fin = np.abs(fin[np.isfinite(fin)])
            qn = np.sqrt(np.sum(q64 * q64, axis=-1))
            kn = np.sqrt(np.sum(k64 * k64, axis=-1))
        fmax = lambda x: float(np.max(x[np.isfinite(x)])) if np.isfinite(x).any() else 0.0
        vv = np.abs(np.asarray(v, dtype=np.float64))
        vmax, u = fmax(vv), unit_roundoff("float64")
        amp = max(lip - 1.0, 0.0)
        dot = 2.0 * (q64.shape[-1] + 1) * abs(sc) * fmax(qn) * fmax(kn)
        return (lip * base + u * vmax * (amp * dot + 16.0 * (float(fin.max()) if fin.size
                                                             else 0.0)))
    vv = np.asarray(v, dtype=np.float64)
    vv = vv[np.isfinite(vv)]
    vmax = float(np.max(np.abs(vv))) if vv.size else 0.0
    sq, sk = np.shape(q)[-2], np.shape(k)[-2]
    add, _ = var.tile(_variant_batch((), var), None, 0, sq, 0, sk, sq, sk, False, np.float64)
    amax = 0.0
    if add is not None:
        fa = np.abs(add)[np.isfinite(add)]
        amax = float(fa.max()) if fa.size else 0.0
    return unit_roundoff("float64") * vmax * (4.0 * amax + 8.0 * var.softcap)


def output_scale(q, k, v, *, causal: bool = False, scale: Optional[float] = None,
                 **variant) -> float:
    """``max_i,c sum_j softmax(s)_ij |v_jc|``: the size of the terms each output sums.

    It bounds ``max|o|`` and is the scale at which rounding the weights p and the output acts:
    where the weighted values cancel (a small ``|o|`` from large ``|v|``), any same-precision
    implementation carries an error of order ``u`` times this, not times ``|o|``.
    """
    o_abs, _ = attention_ref(q, k, np.abs(np.asarray(v, dtype=np.float64)), causal=causal,
                             scale=scale, **variant)
    o_abs = o_abs[np.isfinite(o_abs)]  # NaN/inf inputs: the size of the finite outputs
    return float(np.max(o_abs)) if o_abs.size else 0.0


def tolerance(dtype, o_ref, naive_err, out_scale: Optional[float] = None) -> float:
    """Pass threshold for a fused result in ``dtype``: ``2 * naive_err + 4 * u(dtype) * A``.

    Parameters
    ----------
    dtype : {"float16", "bfloat16", "float32", "float64"}
    o_ref : array_like
        The float64 reference output (:func:`attention_ref`).
    naive_err : float
        The naive same-precision error, :func:`naive_error`.
    out_scale : float, optional
        ``A``, the scale of the summed terms (:func:`output_scale`); default ``max|o_ref|``
        (which it bounds from above).

    Returns
    -------
    float
        The largest acceptable ``max |o - o_ref|``.  ``u`` is the unit roundoff (2^-11 fp16,
        2^-8 bf16, 2^-24 fp32, 2^-53 fp64); the second term, the small absolute term of the rule,
        allows for the few roundings (weights, their sum, the output) that any same-precision
        implementation makes at the scale ``A``, which on small problems (a few output
        elements) the measured naive error, a maximum over few samples, does not reliably show.
    """
    u = unit_roundoff(dtype)
    if out_scale is None:
        o_ref = np.asarray(o_ref, dtype=np.float64)
        out_scale = float(np.max(np.abs(o_ref))) if o_ref.size else 0.0
    return 2.0 * float(naive_err) + 4.0 * u * float(out_scale)


#: Fewest keys per tile of any cuflash path (CPU path 128 by default, generic kernel 32,
#: tensor-core and Hopper kernels 64 or more): bounds the number of rescales of a row's state in
#: :func:`error_bound`.
MIN_KEY_TILE = 16

#: The naive same-precision comparison says little once the naive error itself is a sizeable
#: fraction of the output: above ``NAIVE_INFORMATIVE_FRACTION * max|o_ref|`` the audit calls it
#: uninformative (twice a broken implementation's error is no bar), and only the a-priori bound
#: of :func:`error_bound` judges the case.
NAIVE_INFORMATIVE_FRACTION = 0.05

# Half the spacing of the smallest numbers of each format (subnormals where the conversion keeps
# them, the smallest normal where a kernel flushes to zero): the absolute rounding error of a
# weight p in [0, 2^8] that lands there.
_UNDERFLOW = {"float16": 2.0 ** -25, "bfloat16": 2.0 ** -126, "float32": 2.0 ** -126,
              "float64": 2.0 ** -1022}


def _bound_constants(dtype, precision=None):
    """The arithmetic model of :func:`error_bound` for results stored in ``dtype``.

    ``ua``: unit roundoff of the accumulation (float32; float64 for float64);
    ``u``: the output's unit roundoff; ``e_prod``: relative error of one product q_c k_c or p v
    (2 ua: rounded in the accumulator type; 64 ua for float32, which leaves room for
    split-precision tensor-core products such as 3xTF32, about 12 ua, or 48 ua with truncated
    splits); ``e_exp``: relative error of one exp or exp2 (ex2.approx is 2 ulp = 4 ua; 8 ua);
    ``u_p``: relative rounding of P before the P.V product (the dtype's u for 16-bit kernels,
    split precision ``e_prod`` for float32); ``eta``: absolute rounding of a weight that
    underflows.
    """
    name = _dtype_name(dtype)
    ua = unit_roundoff("float64" if name == "float64" else "float32")
    u = unit_roundoff(name)
    sixteen = name in ("float16", "bfloat16")
    e_prod = 64.0 * ua if name == "float32" else 2.0 * ua
    if name == "float32" and precision == "high":
        # one-pass TF32: each operand rounded to 11 significant bits (2 u_tf32 per product);
        # P's rounding is one of them, so u_p is the same.
        e_prod = 2.0 * 2.0 ** -11 + 2.0 * ua
    return dict(ua=ua, u=u, e_prod=e_prod, e_exp=8.0 * ua, u_p=u if sixteen else e_prod,
                sixteen=sixteen, eta=_UNDERFLOW[name])


# The fp16 split of the float32 "highest" tensor-core forms (kernels_cu/fp16split.cuh): every tile
# of Q, K and V is scaled by a power of two that puts its largest magnitude M in [2^13, 2^14), and
# P (<= 2^8 unnormalised) by 2^7, then x = hi + lo in fp16. Relative to each element the split is
# exact to 2^-22 (inside e_prod), but lo has fp16's subnormal floor: an element far below its
# tile's maximum keeps an absolute error of up to 2^-25 in the scaled units, 2^-38 M unscaled
# (2^-32 for a weight). notes/ERROR_BOUND.md, "Block-scaled splits".
_SPLIT16_FLOOR = 2.0 ** -38
_SPLIT16_P_FLOOR = 2.0 ** -32


def _split16_floor(q, k, v, scale, a, sd, v1, dtype, precision):
    """The fp16 split's absolute floor (above) for float32 outputs in the "highest" modes, as
    an array that broadcasts against o (0 for other dtypes and for "high"): the score error
    scale 2^-37 D M_q M_k (Q's and K's floors through every product) through the weights
    (expm1 of twice it, times sd + A), V's floor 2^-38 M_v (the weights sum to 1) and P's floor
    2^-32 per visible key's |v_j| (v1), doubled for the products' and sums' own roundings on
    these terms."""
    if _dtype_name(dtype) != "float32" or precision == "high":
        return 0.0
    def amax(x):
        with np.errstate(invalid="ignore"):
            return np.max(np.where(np.isfinite(x), np.abs(x), 0.0), axis=(-1, -2), keepdims=True) \
                if x.size else np.zeros(x.shape[:-2] + (1, 1))
    d = q.shape[-1]
    ds = 2.0 * _SPLIT16_FLOOR * abs(float(scale)) * d * amax(q) * amax(k)   # (..., 1, 1)
    with np.errstate(invalid="ignore", over="ignore"):
        return 2.0 * (np.expm1(2.0 * ds) * (sd + a) + _SPLIT16_FLOOR * amax(v)
                      + _SPLIT16_P_FLOOR * v1)


def _bound_one(w, o, a, sd, sig, mx, n_vis, v1, d, dtype, key_tile, rounded_scores,
               precision=None):
    """The bound of :func:`error_bound` for one arithmetic model; arrays as computed there."""
    c = _bound_constants(dtype, precision)
    ua, u, u_p = c["ua"], c["u"], c["u_p"]
    n_r = np.ceil(n_vis / float(key_tile)) + 1.0           # rescales of the state, at most
    # Absolute error of every exponent s_j - m (natural units), per row: the dot product (D
    # products and D additions, each addition 2 ua to allow truncating tensor-core adders), the
    # scaling and the max subtraction (a few roundings of numbers <= max|s|), the exp of the
    # weight, and every rescale of l and O (exp of the max difference, the multiplications).
    delta = ((c["e_prod"] + 2.0 * d * ua) * sig + 12.0 * ua * mx + c["e_exp"]
             + n_r * (c["e_exp"] + 4.0 * ua))
    if c["sixteen"]:
        delta = delta + u   # P rounded to the dtype also in the sum l (as a naive softmax does)
    if rounded_scores:
        delta = delta + u * mx   # scores stored in the dtype (the naive implementation)
    with np.errstate(over="ignore", invalid="ignore"):
        rho = np.expm1(2.0 * delta)[..., None]              # |w'_j / w_j - 1| <= rho
        n_acc = 2.0 * (n_vis + 2.0 * n_r)                    # roundings on one term's path
        gamma = (n_acc * ua / (1.0 - n_acc * ua))[..., None]
        core = (rho * sd + (1.0 + rho) * u_p * a + c["eta"] * v1
                + gamma * (a + np.abs(o)))
        core = core * (1.0 + 2.0 * (rho + u_p + gamma)) + 2.0 * ua * np.abs(o)
        out = core + u * (np.abs(o) + core)
    return np.where(np.asarray(n_vis)[..., None] > 0, out, 0.0)


@_grouped_heads("o")
def error_bound(q, k, v, *, causal: bool = False, scale: Optional[float] = None, dtype,
                key_tile: int = MIN_KEY_TILE, rounded_scores: bool = False,
                precision: Optional[str] = None, **variant) -> np.ndarray:
    """A priori bound on ``|o - o_ref|``, element by element, for a correct kernel in ``dtype``.

    The derivation is in ``notes/ERROR_BOUND.md``.  With ``w`` the exact softmax weights of a
    row, ``o = w @ v``, ``A = w @ |v|`` and ``sigma = sqrt(w @ v^2 - o^2)`` (the spread of the
    values under the weights), a kernel whose exponents ``s_j - m`` are each wrong by at most
    ``Delta`` (the score's dot product, scaling, exp, rescales) has weights
    ``w'_j = w_j (1 + r_j)`` with ``|r_j| <= rho = expm1(2 Delta)``, so
    ``|sum_j (w'_j - w_j) v_j| = |sum_j w_j r_j (v_j - o)| <= rho * sigma``.  To that come the
    rounding of P before P.V (``u_p A`` plus underflow), the accumulation of O and l
    (``gamma (A + |o|)``) and the final rounding (``u |o|``); the float64 reference's own error
    (the same bound in float64) is added.

    Parameters
    ----------
    q : array_like, shape (..., Sq, D)
    k : array_like, shape (..., Sk, D)
    v : array_like, shape (..., Sk, Dv)
        float64 values representable in ``dtype`` (the kernel's inputs).
    causal, scale
        As in :func:`attention_ref`.
    dtype : {"float16", "bfloat16", "float32", "float64"}
        The dtype of the inputs and output.  16-bit kernels accumulate in float32 and may round
        P to the dtype before P.V; float32 kernels may use split-precision products.
    key_tile : int
        Fewest keys per tile of the implementation (the number of rescales is at most
        ``Sk / key_tile + 1``); default :data:`MIN_KEY_TILE`.
    rounded_scores : bool
        Model the naive implementation, which also rounds the scores to ``dtype``.
    precision : {None, "highest", "high"}, optional
        float32 only: ``"high"`` models one-pass TF32 products (every operand of both products,
        P included, rounded to TF32: 2 u_tf32 per product, u_tf32 = 2^-11).
    window, softcap, alibi_slopes, bias, mask : optional
        A variant (as in `cuflash.attention`). The visible-key count per row comes from its
        visibility; the score size ``max|s|`` of the roundings becomes ``max(|s| + 2 |a|)`` over
        the visible keys, ``a`` the additive alibi/bias term (its rounding to float32 and the
        addition act at the size of both terms). softcap's tanh has a derivative <= 1, so the
        dot product's error reaches the exponent undamped at most; its own rounding acts at
        ``|c tanh| <= |s| + |a|``.
    score_mod, mask_mod, mod_args : optional
        User hooks (:mod:`cuflash.mods`). A mask_mod only changes the visible keys. A score_mod
        needs its declared Lipschitz constant ``L`` (``ScoreMod(lipschitz=)``): the dot
        product's error is multiplied by ``L`` and the score roundings act at
        ``L (|s_in| + 2 |a|) + |f(s_in)|``; without one this raises ValueError (`NO_BOUND`).

    Returns
    -------
    ndarray, float64, shape (broadcast batch..., Sq, Dv)
        0 for rows that see no key (their output is exactly 0).  Rows touched by NaN/inf inputs
        get NaN or inf.
    """
    var = _variant(variant, q, k, v)
    if not var.is_plain:
        return _error_bound_variant(q, k, v, causal, scale, dtype, key_tile, rounded_scores,
                                    precision, var)
    q = np.asarray(q, dtype=np.float64)
    k = np.asarray(k, dtype=np.float64)
    v = np.asarray(v, dtype=np.float64)
    d = q.shape[-1]
    if scale is None:
        scale = 1.0 / math.sqrt(d) if d > 0 else 1.0
    with np.errstate(invalid="ignore", over="ignore"):
        s = _scores_f64(q, k, scale, causal)
        sq, sk = s.shape[-2:]
        batch = np.broadcast_shapes(s.shape[:-2], v.shape[:-2])
        s = np.broadcast_to(s, batch + (sq, sk))
        vis = (_causal_mask(sq, sk) if causal else np.ones((sq, sk), dtype=bool))
        n_vis = np.broadcast_to(vis.sum(axis=-1).astype(np.float64), batch + (sq,))
        absdot = abs(float(scale)) * np.matmul(np.abs(q), np.swapaxes(np.abs(k), -1, -2))
        absdot = np.broadcast_to(absdot, batch + (sq, sk))
        sig = np.max(np.where(vis, absdot, 0.0), axis=-1)       # |scale| max_j |q_i|.|k_j|
        mx = np.max(np.where(vis, np.abs(s), 0.0), axis=-1)     # max_j |s_ij|
        w, _ = _weights(s)
        av = np.abs(v)
        o = masked_matmul(w, v, vis if causal else None)
        a = masked_matmul(w, av, vis if causal else None)
        e2 = masked_matmul(w, v * v, vis if causal else None)
        u64 = unit_roundoff("float64")
        sd = np.sqrt(np.maximum(e2 - o * o, 0.0) + (2.0 * n_vis[..., None] + 8.0) * u64 * e2)
        # sum of |v_jc| over the keys row i sees (for the underflow of tiny weights)
        csum = np.cumsum(np.broadcast_to(av, batch + av.shape[-2:]), axis=-2)
        last = np.clip(n_vis.astype(np.intp) - 1, 0, sk - 1)
        v1 = np.take_along_axis(csum, last[..., None], axis=-2) * (n_vis[..., None] > 0)
        if not causal:
            v1 = np.broadcast_to(csum[..., -1:, :], o.shape)
        args = (w, o, a, sd, sig, mx, n_vis, v1, d)
        bound = _bound_one(*args, dtype, key_tile, rounded_scores, precision)
        bound = bound + _bound_one(*args, "float64", sk, False)  # the reference's own rounding
        if not rounded_scores:
            floor = _split16_floor(q, k, v, scale, a, sd, v1, dtype, precision)
            bound = bound + np.where(np.asarray(n_vis)[..., None] > 0, floor, 0.0)
    return bound


def _error_bound_variant(q, k, v, causal, scale, dtype, key_tile, rounded_scores, precision,
                         var):
    """:func:`error_bound` for a non-plain variant (a general visibility pattern). A score_mod
    with Lipschitz constant ``L`` multiplies the dot product's error by ``L`` and the scores'
    roundings act at ``L (|s_in| + 2 |a|) + |f(s_in)|`` (before it, times L; its own, at its
    result); without a declared ``L``: ValueError (`NO_BOUND`)."""
    lip = _hook_lipschitz(var)
    q = np.asarray(q, dtype=np.float64)
    k = np.asarray(k, dtype=np.float64)
    v = np.asarray(v, dtype=np.float64)
    d = q.shape[-1]
    scale = _scale_or_default(scale, d)
    with np.errstate(invalid="ignore", over="ignore"):
        s, _, vis, add = _variant_scores_f64(q, k, scale, causal, var)
        s_in = s
        if var.score_mod is not None:   # the score_mod's input: the built-in parts' score
            s_in = _variant_scores_f64(q, k, scale, causal, var.builtin())[0]
        sq, sk = s.shape[-2:]
        batch = np.broadcast_shapes(s.shape[:-2], v.shape[:-2])
        s = np.broadcast_to(s, batch + (sq, sk))
        vis = np.broadcast_to(np.ones((sq, sk), dtype=bool) if vis is None else vis,
                              batch + (sq, sk))
        n_vis = vis.sum(axis=-1).astype(np.float64)
        absdot = abs(float(scale)) * np.matmul(np.abs(q), np.swapaxes(np.abs(k), -1, -2))
        absdot = np.broadcast_to(absdot, batch + (sq, sk))
        sig = lip * np.max(np.where(vis, absdot, 0.0), axis=-1)
        size = np.abs(s_in) if add is None else np.abs(s_in) + 2.0 * np.abs(add)
        if var.score_mod is not None:
            size = lip * size + np.abs(s)
        mx = np.max(np.where(vis, size, 0.0), axis=-1)
        w, _ = _weights(s)
        av = np.abs(v)
        o = masked_matmul(w, v, vis)
        a = masked_matmul(w, av, vis)
        e2 = masked_matmul(w, v * v, vis)
        u64 = unit_roundoff("float64")
        sd = np.sqrt(np.maximum(e2 - o * o, 0.0) + (2.0 * n_vis[..., None] + 8.0) * u64 * e2)
        v1 = masked_matmul(vis.astype(np.float64), av, vis)   # sum of |v| over visible keys
        args = (w, o, a, sd, sig, mx, n_vis, v1, d)
        bound = _bound_one(*args, dtype, key_tile, rounded_scores, precision)
        bound = bound + _bound_one(*args, "float64", sk, False)
        if not rounded_scores:
            floor = _split16_floor(q, k, v, scale, a, sd, v1, dtype, precision)
            bound = bound + np.where(np.asarray(n_vis)[..., None] > 0, floor, 0.0)
    return bound


def _weights(s):
    """Softmax weights of masked scores (-inf) and the rows that see nothing (weights 0)."""
    empty = np.all(s == -np.inf, axis=-1)
    with np.errstate(invalid="ignore"):
        w = softmax(np.where(empty[..., None], 0.0, s), axis=-1)
    return np.where(empty[..., None], 0.0, w), empty


@dataclass
class Verdict:
    """The pass rule's judgement of one output (see :meth:`PassRule.judge`).

    Attributes
    ----------
    max_abs_err : float
        ``max |o - o_ref|`` over the elements where the reference is finite.
    frac_threshold : float
        ``max_abs_err / threshold`` (the 2x-naive rule passes when <= 1).
    frac_bound : float
        ``max |o - o_ref| / bound`` element by element (the a-priori bound passes when <= 1).
    nonfinite : int
        Elements that are non-finite where the reference is finite, or finite (or NaN for inf)
        where it is not.
    passed : bool
        Both rules hold and the non-finite elements are those of the reference.
    reasons : list of str
        Why not, in words.
    """

    max_abs_err: float
    frac_threshold: float
    frac_bound: float
    nonfinite: int
    passed: bool
    reasons: list


@dataclass
class PassRule:
    """The pass rule for one set of inputs in one dtype: both bars, computed once.

    Attributes
    ----------
    dtype : str
    o_ref : ndarray, float64
        The float64 reference output.
    naive_err : float
        The naive same-precision error (measured; for float64 its forward-error bound).
    naive_kind : {"measured", "bound"}
    out_scale : float
        ``A = max sum_j p_j |v_j|`` (:func:`output_scale`).
    threshold : float
        The 2x-naive rule: ``2 * naive_err + 4 u A`` (:func:`tolerance`) plus any widening.
    bound : ndarray, float64, shape of ``o_ref``
        The a-priori bound of :func:`error_bound` (plus any widening), element by element.
    naive_informative : bool
        False when ``naive_err > NAIVE_INFORMATIVE_FRACTION * max|o_ref|``: then the 2x-naive
        threshold is no bar and only the bound judges.
    """

    dtype: str
    o_ref: np.ndarray
    naive_err: float
    naive_kind: str
    out_scale: float
    threshold: float
    bound: np.ndarray
    naive_informative: bool

    @property
    def bound_max(self) -> float:
        """The largest element of the bound over the finite reference entries."""
        b = self.bound[np.isfinite(self.o_ref) & np.isfinite(self.bound)]
        return float(np.max(b)) if b.size else 0.0

    def widened(self, extra: float) -> "PassRule":
        """The same rule with ``extra`` added to the threshold and to every element of the bound
        (for results that carry a documented extra error, such as a merge of float32 lse)."""
        return PassRule(self.dtype, self.o_ref, self.naive_err, self.naive_kind, self.out_scale,
                        self.threshold + float(extra), self.bound + float(extra),
                        self.naive_informative)

    def judge(self, o) -> Verdict:
        """Judge an output ``o`` (any array convertible to float64, the shape of ``o_ref``).

        A case passes when (1) every element is finite where the reference is, NaN where the
        reference is NaN, and inf or NaN where it is inf; (2) ``max |o - o_ref| <= threshold``
        (the 2x-naive rule); (3) ``|o - o_ref| <= bound`` element by element (the a-priori
        bound).  Errors are taken where the reference is finite.
        """
        o = np.asarray(o, dtype=np.float64)
        ref = self.o_ref
        reasons = []
        if o.shape != ref.shape:
            return Verdict(math.inf, math.inf, math.inf, 0, False,
                           [f"output shape {o.shape}, expected {ref.shape}"])
        fin = np.isfinite(ref)
        lost = int(np.count_nonzero(fin & ~np.isfinite(o)))
        if lost:
            reasons.append(f"{lost} output elements are NaN/inf where the reference is finite "
                           "(never written, or overflow)")
        missed = int(np.count_nonzero(np.isnan(ref) & ~np.isnan(o))
                     + np.count_nonzero(np.isinf(ref) & np.isfinite(o)))
        if missed:
            reasons.append(f"{missed} output elements are finite (or not NaN) where the reference "
                           "is NaN (or inf)")
        bad = lost + missed
        with np.errstate(invalid="ignore"):
            diff = np.where(fin, np.abs(o - ref), 0.0)
        diff_ok = np.where(np.isfinite(diff), diff, math.inf)
        err = float(np.max(diff_ok)) if diff.size else 0.0
        thr = self.threshold
        frac_t = err / thr if thr > 0 else (0.0 if err == 0 else math.inf)
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = np.where(diff_ok == 0, 0.0, diff_ok / np.where(fin, self.bound, 1.0))
        ratio = np.where(np.isnan(ratio), math.inf, ratio)
        frac_b = float(np.max(ratio)) if ratio.size else 0.0
        if not err <= thr:
            reasons.append(f"max abs error {err:.3g} > threshold {thr:.3g} (2x naive rule)")
        if not frac_b <= 1.0:
            reasons.append(f"error {frac_b:.3g}x the a-priori bound somewhere (max bound "
                           f"{self.bound_max:.3g})")
        return Verdict(err, frac_t, frac_b, int(bad), not reasons, reasons)


def pass_threshold(q, k, v, *, causal: bool = False, scale: Optional[float] = None, dtype,
                   o_ref=None, key_tile: int = MIN_KEY_TILE, precision=None,
                   **variant) -> PassRule:
    """The project's one pass rule for inputs q, k, v audited in `dtype`, as a :class:`PassRule`.

    A result passes (``rule.judge(o).passed``) only under both bars: the 2x-naive rule
    ``max|o - o_ref| <= 2 * naive_error + 4 * u(dtype) * output_scale`` (:func:`tolerance`)
    and, element by element, the a-priori forward-error bound of :func:`error_bound`, which a
    broken naive implementation cannot inflate.  ``key_tile``: see :func:`error_bound`.
    ``precision="high"`` (float32): the one-pass TF32 mode, whose naive counterpart is the
    one-pass TF32 matmul -> softmax -> matmul (:func:`naive_attention`) and whose products carry
    TF32's rounding in the bound. ``window``, ``softcap``, ``alibi_slopes``, ``bias``,
    ``mask``, ``score_mod``, ``mask_mod``, ``mod_args``: a variant, as in `cuflash.attention`;
    every part of the rule takes it. A score_mod without a declared Lipschitz constant has no
    a-priori bound: the rule is then the measured 2x-naive bar alone (its bound is inf) and
    raises ValueError where that bar is not informative, and for float64.
    """
    if o_ref is None:
        o_ref, _ = attention_ref(q, k, v, causal=causal, scale=scale, **variant)
    name = _dtype_name(dtype)
    var = _variant(variant, q, k, v)
    # A score_mod without a Lipschitz constant has no a-priori bound: the measured rule alone
    # judges, and only where it is informative (float64 has none to measure: refused).
    unbounded = var.score_mod is not None and var.score_mod.lipschitz is None
    if unbounded and name == "float64":
        raise ValueError(NO_BOUND)
    ne = naive_error(q, k, v, causal=causal, scale=scale, dtype=name, o_ref=o_ref,
                     precision=precision, **variant)
    a = output_scale(q, k, v, causal=causal, scale=scale, **variant)
    if unbounded:
        bound = np.full(np.shape(o_ref), np.inf)
    else:
        bound = error_bound(q, k, v, causal=causal, scale=scale, dtype=name, key_tile=key_tile,
                            precision=precision, **variant)
    fin = np.asarray(o_ref)[np.isfinite(o_ref)]
    size = float(np.max(np.abs(fin))) if fin.size else 0.0
    informative = not ne > NAIVE_INFORMATIVE_FRACTION * size
    if unbounded and not informative:
        raise ValueError(NO_BOUND + f"; here the naive error {ne:.3g} is over "
                         f"{NAIVE_INFORMATIVE_FRACTION} of max|o| = {size:.3g}, so the measured "
                         "rule is no bar either")
    return PassRule(name, np.asarray(o_ref, dtype=np.float64), ne,
                    "bound" if name == "float64" else "measured", a,
                    tolerance(name, o_ref, ne, out_scale=a), bound, informative)


# ---------------------------------------------------------------------------------------------
# the online recurrence
# ---------------------------------------------------------------------------------------------

@dataclass
class OnlineState:
    """Running online-softmax state for a set of query rows.

    Attributes
    ----------
    m : ndarray, shape (*rows)
        Running maximum of the scores seen (``-inf`` before any).
    l : ndarray, shape (*rows)
        ``sum exp(s_seen - m)``.
    O : ndarray, shape (*rows, Dv)
        ``sum exp(s_seen - m) * v_seen`` (unnormalised output).

    ``rows`` is any leading shape (a single row is ``()``).
    """

    m: np.ndarray
    l: np.ndarray
    O: np.ndarray

    def copy(self) -> "OnlineState":
        return OnlineState(self.m.copy(), self.l.copy(), self.O.copy())


def init_state(rows_shape, dv: int, dtype=np.float64) -> OnlineState:
    """The empty state ``(m, l, O) = (-inf, 0, 0)``.

    Parameters
    ----------
    rows_shape : int or tuple of int
        Leading shape of the rows the state covers (``()`` for a single row).
    dv : int
        Value dimension.
    dtype : dtype, default float64
        Precision the state is kept (and every update computed) in.
    """
    if isinstance(rows_shape, (int, np.integer)):
        rows_shape = (int(rows_shape),)
    rows_shape = tuple(rows_shape)
    return OnlineState(
        m=np.full(rows_shape, -np.inf, dtype=dtype),
        l=np.zeros(rows_shape, dtype=dtype),
        O=np.zeros(rows_shape + (int(dv),), dtype=dtype),
    )


def _finite_or_zero(m):
    """``m`` with ``-inf`` replaced by 0: the shift used so that ``exp(-inf - m)`` is 0, not NaN."""
    return np.where(m == -np.inf, np.zeros((), dtype=m.dtype), m)


def update(state: OnlineState, s_chunk, v_chunk) -> OnlineState:
    """Fold one chunk of scores and values into the state; returns a new state.

    Parameters
    ----------
    state : OnlineState
        Rows of shape ``rows``; the state's dtype is the working precision (the chunk is cast to
        it, as a kernel loads fp16 tiles into fp32 registers).
    s_chunk : array_like, shape (*rows, c)
        Scores of the chunk (``-inf`` for masked entries).
    v_chunk : array_like, shape (c, Dv) or (*rows, c, Dv)
        Values of the chunk, shared by all rows or per row.

    Returns
    -------
    OnlineState
        ``m' = max(m, max s)``, ``l' = exp(m - m') l + sum exp(s - m')``,
        ``O' = exp(m - m') O + exp(s - m') @ v``.  A row whose scores so far are all ``-inf``
        stays at ``(-inf, 0, 0)``.
    """
    dt = state.m.dtype
    s = np.asarray(s_chunk).astype(dt, copy=False)
    v = np.asarray(v_chunk).astype(dt, copy=False)
    if s.shape[-1] == 0:
        return state.copy()
    m_new = np.maximum(state.m, np.max(s, axis=-1))
    shift = _finite_or_zero(m_new)
    alpha = np.exp(state.m - shift)
    p = np.exp(s - shift[..., None])
    l_new = alpha * state.l + np.sum(p, axis=-1)
    if v.ndim == 2:
        pv = np.matmul(p, v)
    else:
        pv = np.matmul(p[..., None, :], v)[..., 0, :]
    o_new = alpha[..., None] * state.O + pv
    return OnlineState(m=m_new, l=l_new, O=o_new)


def finalize(state: OnlineState):
    """Divide once: ``o = O / l`` and ``lse = m + log(l)``.

    Returns
    -------
    o : ndarray, shape (*rows, Dv)
    lse : ndarray, shape (*rows)
        Rows that saw no finite score give ``o = 0`` and ``lse = -inf``.
    """
    empty = state.m == -np.inf
    l_safe = np.where(empty, np.ones((), dtype=state.l.dtype), state.l)
    o = np.where(empty[..., None], np.zeros((), dtype=state.O.dtype), state.O / l_safe[..., None])
    lse = np.where(empty, -np.inf, state.m + np.log(l_safe)).astype(state.m.dtype)
    return o, lse


def merge_state(a: OnlineState, b: OnlineState) -> OnlineState:
    """Combine two states built from disjoint key sets into the state of their union.

    ``m = max(m_a, m_b)``, ``l = l_a e^(m_a-m) + l_b e^(m_b-m)``, ``O = O_a e^(m_a-m) + O_b e^(m_b-m)``.
    Associative and commutative, with identity ``(-inf, 0, 0)`` (guarded, no NaN).
    """
    m = np.maximum(a.m, b.m)
    shift = _finite_or_zero(m)
    wa = np.exp(a.m - shift)
    wb = np.exp(b.m - shift)
    l = a.l * wa + b.l * wb
    O = a.O * wa[..., None] + b.O * wb[..., None]
    return OnlineState(m=m, l=l, O=O)


ChunkSpec = Union[int, Sequence[int], Sequence[Sequence[int]]]


def _chunk_indices(chunks: ChunkSpec, n: int):
    """Turn a chunk specification into a list of integer index arrays partitioning range(n)."""
    if isinstance(chunks, (int, np.integer)):
        size = int(chunks)
        if size <= 0:
            raise ValueError("chunk size must be positive")
        return [np.arange(i, min(i + size, n)) for i in range(0, n, size)]
    chunks = list(chunks)
    if all(isinstance(c, (int, np.integer)) for c in chunks):
        sizes = [int(c) for c in chunks]
        if any(c < 0 for c in sizes) or sum(sizes) != n:
            raise ValueError(f"chunk sizes {sizes} must be non-negative and sum to {n}")
        bounds = np.cumsum([0] + sizes)
        return [np.arange(bounds[i], bounds[i + 1]) for i in range(len(sizes))]
    idx = [np.asarray(c, dtype=np.intp).reshape(-1) for c in chunks]
    allidx = np.sort(np.concatenate(idx)) if idx else np.zeros(0, dtype=np.intp)
    if allidx.shape[0] != n or not np.array_equal(allidx, np.arange(n)):
        raise ValueError(f"index chunks must partition range({n})")
    return idx


def online_softmax(s, v, chunks: ChunkSpec, order: Optional[Sequence[int]] = None,
                   return_history: bool = False, state_dtype=None):
    """Compute ``softmax(s) @ v`` by streaming the keys through the recurrence chunk by chunk.

    Parameters
    ----------
    s : array_like, shape (*rows, n)
        Scores (``-inf`` = masked).
    v : array_like, shape (n, Dv) or (*rows, n, Dv)
    chunks : int, sequence of int, or sequence of index arrays
        How the n keys are split: a single chunk size (last chunk shorter), a list of chunk
        sizes summing to n (contiguous chunks), or a list of index arrays that together
        partition ``range(n)`` (chunks need not be contiguous).
    order : sequence of int, optional
        Order in which the chunks are processed (a permutation of ``range(len(chunks))``);
        default is the given order.  The result does not depend on it up to rounding.
    return_history : bool
        Also return the list of states after each processed chunk.
    state_dtype : dtype, optional
        Working precision; default float32 for float16/float32 scores, float64 otherwise.

    Returns
    -------
    o : ndarray, shape (*rows, Dv)
    lse : ndarray, shape (*rows)
    history : list of OnlineState
        Only with ``return_history``; ``history[t]`` is the state after the t-th processed chunk.
    """
    s = np.asarray(s)
    v = np.asarray(v)
    if state_dtype is None:
        low = s.dtype.name in ("float16", "bfloat16", "float32")
        state_dtype = np.float32 if low else np.float64
    if s.ndim < 1:
        raise ValueError("s needs at least one dimension")
    n = s.shape[-1]
    if v.ndim < 2 or v.shape[-2] != n:
        raise ValueError(f"v must have shape (n={n}, Dv) or (*rows, n, Dv); got {v.shape}")
    idx = _chunk_indices(chunks, n)
    if order is None:
        order = range(len(idx))
    order = [int(t) for t in order]
    if sorted(order) != list(range(len(idx))):
        raise ValueError(f"order must be a permutation of range({len(idx)})")

    state = init_state(s.shape[:-1], v.shape[-1], dtype=state_dtype)
    history = []
    for t in order:
        ix = idx[t]
        state = update(state, s[..., ix], v[..., ix, :])
        if return_history:
            history.append(state.copy())
    o, lse = finalize(state)
    if return_history:
        return o, lse, history
    return o, lse


def merge_normalized(o_a, lse_a, o_b, lse_b):
    """Merge two normalised partial results over disjoint key sets (float64).

    Parameters
    ----------
    o_a, o_b : array_like, shape (..., Dv)
    lse_a, lse_b : array_like, shape (...)
        An empty part is ``(o = 0, lse = -inf)``.

    Returns
    -------
    o : ndarray, float64, shape (..., Dv)
        ``o_a exp(lse_a - lse) + o_b exp(lse_b - lse)``; 0 when both parts are empty.
    lse : ndarray, float64, shape (...)
        ``logaddexp(lse_a, lse_b)``.
    """
    o_a = np.asarray(o_a, dtype=np.float64)
    o_b = np.asarray(o_b, dtype=np.float64)
    lse_a = np.asarray(lse_a, dtype=np.float64)
    lse_b = np.asarray(lse_b, dtype=np.float64)
    lse = np.logaddexp(lse_a, lse_b)
    shift = _finite_or_zero(lse)
    wa = np.exp(lse_a - shift)
    wb = np.exp(lse_b - shift)
    o = o_a * wa[..., None] + o_b * wb[..., None]
    return o, lse


def unstable_softmax(s, dtype) -> np.ndarray:
    """``exp(s) / sum(exp(s))`` computed entirely in ``dtype``, without subtracting the max.

    For illustration only: ``exp`` overflows to ``inf`` for ``s`` above about 11.09 in float16
    (and about 88.7 in float32), and the division then yields ``nan``.  Overflow warnings are
    suppressed because the overflow is the point.

    Parameters
    ----------
    s : array_like, shape (..., n)
    dtype : a NumPy floating dtype

    Returns
    -------
    ndarray of ``dtype``, shape (..., n)
    """
    s = np.asarray(s).astype(dtype)
    with np.errstate(over="ignore", invalid="ignore"):
        e = np.exp(s)
        return e / np.sum(e, axis=-1, keepdims=True, dtype=e.dtype)


# =============================================================================================
# Backward pass (issue 11): float64 gradients, finite differences, a naive same-precision
# backward and the gradient version of the pass rule. Kept in its own section.
# =============================================================================================
#
# For one batch entry with P = softmax(S), S = scale * q k^T (masked: -inf), o = P v and an
# upstream gradient do = dL/do:
#
#     dv = P^T do,   dP = do v^T,   delta_i = sum_c do_ic o_ic  (= sum_j P_ij dP_ij),
#     dS = P * (dP - delta),   dq = scale dS k,   dk = scale dS^T q.
#
# Rows that see no key have P = 0 and contribute nothing. Batch axes along which an input
# broadcasts give its gradient summed over them (with the input's own shape).

__all__ += [
    "attention_backward_ref",
    "attention_backward_fd",
    "naive_attention_backward",
    "gradient_scales",
    "naive_gradient_error_bound_f64",
    "naive_gradient_errors",
    "grad_pass_threshold",
]


def _sum_to_shape(x, shape):
    """Sum ``x`` (shape broadcast batch + last two) over the axes along which ``shape`` was
    broadcast, returning an array of ``shape``."""
    shape = tuple(shape)
    lead = x.ndim - len(shape)
    if lead:
        x = x.sum(axis=tuple(range(lead)))
    axes = tuple(a for a, n in enumerate(shape) if n == 1 and x.shape[a] != 1)
    if axes:
        x = x.sum(axis=axes, keepdims=True)
    return x.reshape(shape)


def _probabilities_f64(q, k, v, causal, scale, var=None, want_tanh=False):
    """float64 (P, o, batch) with P = softmax of the masked scores, 0 on rows that see no key
    (with ``want_tanh`` also the variant's derivative d score / d scaled score, or None; a
    score_mod without a derivative raises ValueError then)."""
    v = np.asarray(v, dtype=np.float64)
    th = None
    if var is not None and not var.is_plain:
        if want_tanh:
            var.need_grad()
        s, th, _, _ = _variant_scores_f64(q, k, scale, causal, var)
    else:
        s = _scores_f64(q, k, scale, causal)
    batch = np.broadcast_shapes(s.shape[:-2], v.shape[:-2])
    s = np.broadcast_to(s, batch + s.shape[-2:])
    empty = np.all(s == -np.inf, axis=-1)
    p = softmax(np.where(empty[..., None], 0.0, s), axis=-1)
    p = np.where(empty[..., None], 0.0, p)
    if want_tanh:
        return p, np.matmul(p, v), batch, th
    return p, np.matmul(p, v), batch


def _score_grads(ds, th, scale, var, q64, k64, return_dbias):
    """(dq, dk[, dbias]) from the gradient ``ds`` of the final scores: dbias is ``ds`` summed
    to the bias's shape; under softcap the scaled score's gradient is ``ds (1 - tanh^2)``."""
    dbias = None
    if return_dbias:
        if var.bias is None:
            raise ValueError("return_dbias=True needs bias=")
        var.need_grad(True)
        dbias = _sum_to_shape(ds, np.shape(var.bias))
    if th is not None:   # the variant's derivative (softcap's 1 - tanh^2, a score_mod's)
        ds = ds * th
    dq = scale * np.matmul(ds, k64)
    dk = scale * np.matmul(np.swapaxes(ds, -1, -2), q64)
    return dq, dk, dbias


def _scale_or_default(scale, d):
    return 1.0 / math.sqrt(d) if scale is None else float(scale)


@_grouped_heads("grads")
def attention_backward_ref(do, q, k, v, *, causal: bool = False, scale: Optional[float] = None,
                           return_dbias: bool = False, **variant):
    """Gradients of ``L = sum(do * attention(q, k, v))`` in float64, from SciPy's softmax.

    Parameters
    ----------
    do : array_like, shape (broadcast batch..., Sq, Dv)
        The upstream gradient dL/do.
    q : array_like, shape (..., Sq, D)
    k : array_like, shape (..., Sk, D)
    v : array_like, shape (..., Sk, Dv)
        Any real dtype (converted to float64); batch axes broadcast as in :func:`attention_ref`.
    causal, scale, window, softcap, alibi_slopes, bias, mask
        As in :func:`attention_ref`.
    return_dbias : bool
        Also return ``dbias`` (needs ``bias``): the gradient of the final scores, summed over
        the axes along which ``bias`` broadcasts.

    Returns
    -------
    dq, dk, dv : ndarray, float64, the shapes of q, k and v
        Summed over the batch axes along which each input was broadcast. Rows that see no key
        contribute zero (never NaN).
    dbias : ndarray, float64, the shape of bias
        Only with ``return_dbias=True``.
    """
    var = _variant(variant, q, k, v)
    q64, k64, v64 = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    scale = _scale_or_default(scale, q64.shape[-1])
    p, o, batch, th = _probabilities_f64(q64, k64, v64, causal, scale, var, want_tanh=True)
    do = np.broadcast_to(np.asarray(do, dtype=np.float64), batch + o.shape[-2:])
    dv = np.matmul(np.swapaxes(p, -1, -2), do)
    dp = np.matmul(do, np.swapaxes(v64, -1, -2))
    delta = np.sum(do * o, axis=-1, keepdims=True)
    ds = np.where(p > 0, p * (dp - delta), 0.0)
    dq, dk, dbias = _score_grads(ds, th, scale, var, q64, k64, return_dbias)
    grads = (_sum_to_shape(dq, q64.shape), _sum_to_shape(dk, k64.shape),
             _sum_to_shape(dv, v64.shape))
    return grads + (dbias,) if return_dbias else grads


def attention_backward_fd(do, q, k, v, *, causal: bool = False, scale: Optional[float] = None,
                          eps: Optional[float] = None, return_dbias: bool = False, **variant):
    """Gradients of ``L = sum(do * attention_ref(q, k, v)[0])`` by central finite differences.

    ``dL/dx = (L(x + h) - L(x - h)) / (2 h)`` for every element x of q, k and v, with
    ``h = eps * max(1, |x|)`` (default eps = 2^-18, near the cube root of float64's unit roundoff,
    where truncation and rounding errors balance). Two forward passes per element: for small
    cases only (a check of :func:`attention_backward_ref`).

    Variant arguments as in :func:`attention_ref`; with ``return_dbias=True`` the bias is
    differentiated too.

    Returns
    -------
    dq, dk, dv : ndarray, float64, the shapes of q, k and v
    dbias : ndarray, float64, the shape of bias (only with ``return_dbias=True``)
    """
    q64, k64, v64 = (np.array(x, dtype=np.float64) for x in (q, k, v))
    scale = _scale_or_default(scale, q64.shape[-1])
    do = np.asarray(do, dtype=np.float64)
    eps = 2.0 ** -18 if eps is None else float(eps)
    arrays = [q64, k64, v64]
    variant = dict(variant)
    if return_dbias:
        variant["bias"] = np.array(variant["bias"], dtype=np.float64)
        arrays.append(variant["bias"])

    def loss():
        o, _ = attention_ref(*arrays[:3], causal=causal, scale=scale, **variant)
        return float(np.sum(do * o))

    grads = []
    for x in arrays:
        g = np.zeros_like(x)
        flat, gflat = x.reshape(-1), g.reshape(-1)
        for i in range(flat.size):
            x0 = flat[i]
            h = eps * max(1.0, abs(x0))
            flat[i] = x0 + h
            lp = loss()
            flat[i] = x0 - h
            lm = loss()
            flat[i] = x0
            gflat[i] = (lp - lm) / (2.0 * h)
        grads.append(g)
    return tuple(grads)


@_grouped_heads("grads")
def naive_attention_backward(do, q, k, v, *, causal: bool = False, scale: Optional[float] = None,
                             dtype, return_dbias: bool = False, **variant):
    """The backward a user gets from the unfused attention written by hand in ``dtype``.

    The forward of :func:`naive_attention` (S -> P -> o, each stage rounded to ``dtype``), then
    the backward of each stage as automatic differentiation runs it, products accumulating in
    float32 (float64 for float64) and each stage's result rounded to ``dtype``::

        dv = rnd(P^T do),  dP = rnd(do v^T),  dS = rnd(P * (dP - rowsum(P * dP))),
        dq = rnd(scale dS k),  dk = rnd(scale dS^T q)

    and per-entry gradients of broadcast inputs summed (in the working precision) and rounded.

    Parameters
    ----------
    do, q, k, v : array_like
        float64 arrays holding values representable in ``dtype``; shapes as in
        :func:`attention_backward_ref`.
    causal, scale, window, softcap, alibi_slopes, bias, mask
        As in :func:`attention_ref` (the variant's steps as :func:`naive_attention` takes them;
        under softcap ``dS_t = rnd(dS * (1 - tanh^2))``).
    dtype : {"float16", "bfloat16", "float32", "float64"}
    return_dbias : bool
        Also return dbias (``dS`` summed to the bias's shape, rounded).

    Returns
    -------
    dq, dk, dv : ndarray, float64, the shapes of q, k and v; values representable in ``dtype``.
    dbias : ndarray, float64, the shape of bias (with ``return_dbias``).
    """
    var = _variant(variant, q, k, v)
    name = _dtype_name(dtype)
    wd = np.float64 if name == "float64" else np.float32

    def rnd(x):
        if name in ("float32", "float64"):
            return np.asarray(x, dtype=wd)
        return round_to(np.asarray(x, dtype=np.float64), name).astype(wd)

    qw, kw, vw = (np.asarray(x, dtype=np.float64).astype(wd) for x in (q, k, v))
    scale = _scale_or_default(scale, qw.shape[-1])
    s = rnd(np.matmul(qw, np.swapaxes(kw, -1, -2)) * wd(scale))
    th = None
    if not var.is_plain:
        s, _, th = _naive_variant_scores(s, var, causal, rnd, want_tanh=True)
    elif causal:
        s = np.where(_causal_mask(s.shape[-2], s.shape[-1]), s, wd(-np.inf))
    batch = np.broadcast_shapes(s.shape[:-2], vw.shape[:-2])
    s = np.broadcast_to(s, batch + s.shape[-2:])
    m = np.max(s, axis=-1, keepdims=True)
    empty = m == -np.inf
    e = np.exp(s - np.where(empty, wd(0), m))
    den = np.where(empty, wd(1), np.sum(e, axis=-1, keepdims=True, dtype=wd))
    p = rnd(e / den)
    dow = np.broadcast_to(np.asarray(do, dtype=np.float64).astype(wd), batch + (s.shape[-2], vw.shape[-1]))
    dv = rnd(np.matmul(np.swapaxes(p, -1, -2), dow))
    dp = rnd(np.matmul(dow, np.swapaxes(vw, -1, -2)))
    ds = rnd(p * (dp - np.sum(p * dp, axis=-1, keepdims=True, dtype=wd)))
    dbias = None
    if return_dbias:
        if var.bias is None:
            raise ValueError("return_dbias=True needs bias=")
        var.need_grad(True)
        dbias = np.asarray(rnd(_sum_to_shape(ds, np.shape(var.bias))), dtype=np.float64)
    if th is not None:
        ds = rnd(ds * th)   # th: the variant's derivative (softcap, score_mod)
    dq = rnd(np.matmul(ds, kw) * wd(scale))
    dk = rnd(np.matmul(np.swapaxes(ds, -1, -2), qw) * wd(scale))
    out = []
    for g, x in ((dq, qw), (dk, kw), (dv, vw)):
        summed = _sum_to_shape(g, x.shape)
        out.append(np.asarray(rnd(summed) if summed.shape != g.shape else g, dtype=np.float64))
    return tuple(out) + ((dbias,) if return_dbias else ())


@_grouped_heads("bwd_scalars")
def gradient_scales(do, q, k, v, *, causal: bool = False, scale: Optional[float] = None,
                    return_dbias: bool = False, **variant):
    """``(A_dq, A_dk, A_dv)``: the size of the terms each element of dq, dk, dv sums.

    The backward run on magnitudes: ``A_dv = max (P^T |do|)``, ``A_dq = |scale| max (G |k|)``,
    ``A_dk = |scale| max (G^T |q|)`` with ``G = P * (|dP| + |delta|)``, the two terms of
    ``dS = P * (dP - delta)`` before they cancel (a single visible key gives dS = 0 from two equal
    rounded terms), summed over broadcast axes as the gradients are (they bound ``max|dv|``,
    ``max|dq|``, ``max|dk|``). As :func:`output_scale` for the forward, it is the scale at which
    the few roundings any same-precision backward makes act. With ``return_dbias`` a fourth,
    ``A_dbias = max`` of ``G`` summed to the bias's shape; under softcap ``G`` carries the cap's
    derivative ``1 - tanh^2`` for dq and dk.
    """
    var = _variant(variant, q, k, v)
    q64, k64, v64 = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    scale = _scale_or_default(scale, q64.shape[-1])
    p, o, batch, th = _probabilities_f64(q64, k64, v64, causal, scale, var, want_tanh=True)
    ado = np.abs(np.broadcast_to(np.asarray(do, dtype=np.float64), batch + o.shape[-2:]))
    dv = np.matmul(np.swapaxes(p, -1, -2), ado)
    do_ = np.broadcast_to(np.asarray(do, dtype=np.float64), batch + o.shape[-2:])
    dp = np.matmul(do_, np.swapaxes(v64, -1, -2))
    delta = np.sum(do_ * o, axis=-1, keepdims=True)
    dsm = np.where(p > 0, p * (np.abs(dp) + np.abs(delta)), 0.0)
    extra = ()
    if return_dbias:
        if var.bias is None:
            raise ValueError("return_dbias=True needs bias=")
        var.need_grad(True)
        extra = (float(np.max(_sum_to_shape(dsm, np.shape(var.bias)))),)
    if th is not None:   # the variant's derivative, in magnitude
        dsm = dsm * np.abs(th)
    dq = abs(scale) * np.matmul(dsm, np.abs(k64))
    dk = abs(scale) * np.matmul(np.swapaxes(dsm, -1, -2), np.abs(q64))
    return tuple(float(np.max(_sum_to_shape(g, x.shape))) if g.size else 0.0
                 for g, x in ((dq, q64), (dk, k64), (dv, v64))) + extra


def naive_gradient_error_bound_f64(do, q, k, v, *, causal: bool = False,
                                   scale: Optional[float] = None, scales=None,
                                   return_dbias: bool = False, **variant):
    """A priori bounds on the max abs errors of a float64 backward, ``(dq, dk, dv)``.

    The gradient counterpart of :func:`naive_error_bound_f64`: the scores carry at most
    ``(D + 1) u |scale| |q| |k|`` absolute error, which moves each P by twice that relative
    amount; dP and delta are dot products of Dv terms; the sums over Sq or Sk rows add their
    length in roundings. With ``A_X`` from :func:`gradient_scales` (the terms' magnitudes)::

        bound_X = u * A_X * (2 (D + 1) |scale| max|q_i| max|k_j| + 2 (Dv + Sq + Sk) + 8)

    with u = 2^-53 and |q_i|, |k_j| the Euclidean norms of the rows.
    """
    q64, k64 = (np.asarray(x, dtype=np.float64) for x in (q, k))
    d, sq, sk = q64.shape[-1], q64.shape[-2], k64.shape[-2]
    dv_dim = np.shape(v)[-1]
    scale = _scale_or_default(scale, d)
    if scales is None:
        scales = gradient_scales(do, q, k, v, causal=causal, scale=scale,
                                 return_dbias=return_dbias, **variant)
    qn = float(np.max(np.sqrt(np.sum(q64 * q64, axis=-1))))
    kn = float(np.max(np.sqrt(np.sum(k64 * k64, axis=-1))))
    factor = 2.0 * (d + 1) * abs(scale) * qn * kn + 2.0 * (dv_dim + sq + sk) + 8.0
    vmax = float(np.max(np.abs(np.asarray(v, dtype=np.float64))))
    if vmax > 0:   # the variant's roundings, relative (see _variant_f64_extra)
        factor += _variant_f64_extra(q, k, v, variant, scale) / (unit_roundoff("float64") * vmax)
    u = unit_roundoff("float64")
    return tuple(u * a * factor for a in scales)


def _max_abs_diff(a, b):
    diff = np.abs(np.asarray(a, dtype=np.float64) - b)
    diff = diff[np.isfinite(diff)]
    return float(diff.max()) if diff.size else 0.0


def naive_gradient_errors(do, q, k, v, *, causal: bool = False, scale: Optional[float] = None,
                          dtype, ref=None, scales=None, return_dbias: bool = False, **variant):
    """Max abs errors of :func:`naive_attention_backward` in ``dtype`` against the float64
    gradients, ``(dq, dk, dv)``; for float64 the bounds of
    :func:`naive_gradient_error_bound_f64`. ``ref``: :func:`attention_backward_ref`'s result."""
    if _dtype_name(dtype) == "float64":
        return naive_gradient_error_bound_f64(do, q, k, v, causal=causal, scale=scale,
                                              scales=scales, return_dbias=return_dbias,
                                              **variant)
    if ref is None:
        ref = attention_backward_ref(do, q, k, v, causal=causal, scale=scale,
                                     return_dbias=return_dbias, **variant)
    naive = naive_attention_backward(do, q, k, v, causal=causal, scale=scale, dtype=dtype,
                                     return_dbias=return_dbias, **variant)
    return tuple(_max_abs_diff(n, r) for n, r in zip(naive, ref))


def backward_lse_error(q, k, v, *, causal: bool = False, scale: Optional[float] = None,
                       dtype, **variant) -> float:
    """Relative error of the backward's ``P = exp(s - lse)`` that comes from the forward's lse
    being float32: ``4 * 2^-24 * max(1, max|lse|)`` for float16 and bfloat16, 0 for float32 and
    float64, whose backward paths recompute each row's softmax max m and sum l and form
    ``P = exp(s - m) / l`` as the naive softmax does (notes/BACKWARD.md: every float32 or
    float64 backward must). See :func:`grad_pass_threshold`."""
    if _dtype_name(dtype) in ("float32", "float64"):
        return 0.0
    _, lse_ref = attention_ref(q, k, v, causal=causal, scale=scale, **variant)
    fin = np.abs(lse_ref[np.isfinite(lse_ref)])
    return 4.0 * unit_roundoff("float32") * max(1.0, float(fin.max()) if fin.size else 0.0)


def grad_pass_threshold(do, q, k, v, *, causal: bool = False, scale: Optional[float] = None,
                        dtype, ref=None, return_dbias: bool = False, **variant):
    """The pass rule for gradients, one call: ``((tol_dq, tol_dk, tol_dv), (naive errors))``.

    Each gradient X gets the forward's rule (:func:`tolerance`): ``2 * naive_err_X +
    4 * u(dtype) * A_X``, with the naive same-precision backward's error
    (:func:`naive_gradient_errors`) and the terms' size ``A_X`` (:func:`gradient_scales`),
    plus ``4 * 2^-24 * max(1, max|lse|) * A_X`` for float16 and bfloat16: their backward takes
    the forward's lse, which is float32 (the API's lse dtype), and recomputes
    ``P = exp(s - lse)`` from it, so P carries a relative error of a few float32 roundings of
    ``|lse|`` that the naive backward, which normalises its own softmax, does not (with one
    visible key its P is exactly 1 and its error 0). float32 and float64 backward paths
    recompute each row's max and sum and get no such term (:func:`backward_lse_error`).
    ``ref``: :func:`attention_backward_ref`'s result for these inputs, if already computed.
    Variant arguments as in :func:`attention_ref`; with ``return_dbias=True`` both tuples get a
    fourth entry, for dbias (``ref`` then holds four gradients).
    """
    kw = dict(causal=causal, scale=scale, return_dbias=return_dbias, **variant)
    if ref is None:
        ref = attention_backward_ref(do, q, k, v, **kw)
    scales = gradient_scales(do, q, k, v, **kw)
    errs = naive_gradient_errors(do, q, k, v, dtype=dtype, ref=ref, scales=scales, **kw)
    lse_rel = backward_lse_error(q, k, v, causal=causal, scale=scale, dtype=dtype, **variant)
    tols = tuple(tolerance(dtype, r, e, out_scale=a) + lse_rel * a
                 for r, e, a in zip(ref, errs, scales))
    if return_dbias:
        # dbias is stored in bias's dtype: one more rounding where that is narrower.
        bname = _dtype_name(np.asarray(variant["bias"]).dtype)
        extra = 2.0 * unit_roundoff(bname) * scales[3] if bname in _UNIT_ROUNDOFF else 0.0
        tols = tols[:3] + (tols[3] + extra,)
    return tols, errs


# ---------------------------------------------------------------------------------------------
# KV caches and packed variable-length batches (notes/INFERENCE.md)
# ---------------------------------------------------------------------------------------------

def gather_kv_cache(k_cache, v_cache, length: int, seq: int, block_table=None):
    """The first ``length`` keys and values of sequence ``seq`` of a KV cache, ``(length, Hkv, D)``
    each: rows ``seq`` of a contiguous cache ``(B, Smax, Hkv, D)``, or for a paged cache
    ``(num_pages, page_size, Hkv, D)`` key ``j`` at page ``block_table[seq, j // page_size]``, row
    ``j % page_size``."""
    k_cache, v_cache = np.asarray(k_cache), np.asarray(v_cache)
    keys = np.arange(int(length))
    if block_table is None:
        return k_cache[seq, keys], v_cache[seq, keys]
    page = k_cache.shape[1]
    pages = np.asarray(block_table)[seq, keys // page]
    return k_cache[pages, keys % page], v_cache[pages, keys % page]


def attention_with_kvcache_ref(q, k_cache, v_cache, cache_seqlens, *, block_table=None,
                               k_new=None, v_new=None, causal: bool = False,
                               scale: Optional[float] = None):
    """float64 truth of ``cuflash.attention_with_kvcache`` (the caches are not modified).

    Sequence ``b`` attends to its ``cache_seqlens[b]`` cached keys followed by its ``Snew`` new
    ones (``k_new[b]``, ``v_new[b]``); q ``(B, Sq, H, D)``, caches ``(B, Smax, Hkv, D)`` or paged
    ``(num_pages, page_size, Hkv, D)`` with ``block_table`` ``(B, max_pages)``; grouped heads as
    in :func:`attention_ref`; the causal mask bottom-right aligned per sequence.

    Returns
    -------
    o : ndarray, float64, (B, Sq, H, Dv)
    lse : ndarray, float64, (B, H, Sq); a sequence with no key gives o = 0, lse = -inf.
    """
    q = np.asarray(q, dtype=np.float64)
    b, sq, h, _ = q.shape
    dv = np.shape(v_cache)[-1]
    lens = np.broadcast_to(np.asarray(cache_seqlens), (b,))
    o = np.zeros((b, sq, h, dv))
    lse = np.full((b, h, sq), -np.inf)
    for i in range(b):
        k_i, v_i = gather_kv_cache(k_cache, v_cache, int(lens[i]), i, block_table)
        if k_new is not None:
            k_i = np.concatenate([k_i, np.asarray(k_new)[i]], axis=0)
            v_i = np.concatenate([v_i, np.asarray(v_new)[i]], axis=0)
        if k_i.shape[0] == 0:
            continue
        o_i, lse_i = attention_ref(q[i].transpose(1, 0, 2), k_i.transpose(1, 0, 2),
                                   v_i.transpose(1, 0, 2), causal=causal, scale=scale)
        o[i] = o_i.transpose(1, 0, 2)
        lse[i] = lse_i
    return o, lse


def attention_varlen_ref(q, k, v, cu_seqlens_q, cu_seqlens_k, *, causal: bool = False,
                         scale: Optional[float] = None):
    """float64 truth of ``cuflash.attention_varlen``: q ``(total_q, H, D)``, k ``(total_k, Hkv,
    D)``, v ``(total_k, Hkv, Dv)``, sequence ``s`` the rows ``cu[s]:cu[s + 1]``; grouped heads and
    the per-sequence bottom-right causal mask as in :func:`attention_ref`.

    Returns o ``(total_q, H, Dv)`` and lse ``(H, total_q)``, float64; rows of no sequence or of a
    sequence with no key give o = 0, lse = -inf."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    cq, ck = np.asarray(cu_seqlens_q), np.asarray(cu_seqlens_k)
    o = np.zeros(q.shape[:2] + (v.shape[-1],))
    lse = np.full((q.shape[1], q.shape[0]), -np.inf)
    for s in range(cq.size - 1):
        q0, q1, k0, k1 = int(cq[s]), int(cq[s + 1]), int(ck[s]), int(ck[s + 1])
        if q1 == q0 or k1 == k0:
            continue
        o_s, lse_s = attention_ref(q[q0:q1].transpose(1, 0, 2), k[k0:k1].transpose(1, 0, 2),
                                   v[k0:k1].transpose(1, 0, 2), causal=causal, scale=scale)
        o[q0:q1] = o_s.transpose(1, 0, 2)
        lse[:, q0:q1] = lse_s
    return o, lse


def attention_varlen_backward_ref(do, q, k, v, cu_seqlens_q, cu_seqlens_k, *,
                                  causal: bool = False, scale: Optional[float] = None):
    """float64 truth of ``cuflash.attention_varlen_backward``: :func:`attention_backward_ref`
    per sequence on the packed layouts of :func:`attention_varlen_ref` (do ``(total_q, H, Dv)``).

    Returns dq ``(total_q, H, D)``, dk ``(total_k, Hkv, D)``, dv ``(total_k, Hkv, Dv)``, float64;
    dk and dv sum over the query heads of a group; rows of no sequence, of a sequence with no
    key or no query, and query rows that see no key get 0."""
    do, q, k, v = (np.asarray(x, dtype=np.float64) for x in (do, q, k, v))
    cq, ck = np.asarray(cu_seqlens_q), np.asarray(cu_seqlens_k)
    dq, dk, dv = np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)
    for s in range(cq.size - 1):
        q0, q1, k0, k1 = int(cq[s]), int(cq[s + 1]), int(ck[s]), int(ck[s + 1])
        if q1 == q0 or k1 == k0:
            continue
        grads = attention_backward_ref(*(x.transpose(1, 0, 2) for x in (
            do[q0:q1], q[q0:q1], k[k0:k1], v[k0:k1])), causal=causal, scale=scale)
        for g, x, lo, hi in zip(grads, (dq, dk, dv), (q0, k0, k0), (q1, k1, k1)):
            x[lo:hi] = g.transpose(1, 0, 2)
    return dq, dk, dv
