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
given precision; its error against the float64 truth sets the bar a fused kernel must meet, see
:func:`tolerance`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import numpy as np
from scipy.special import logsumexp, softmax

__all__ = [
    "attention_ref",
    "naive_attention",
    "round_to",
    "round_to_tf32",
    "tolerance",
    "naive_error",
    "output_scale",
    "pass_threshold",
    "naive_error_bound_f64",
    "unit_roundoff",
    "OnlineState",
    "init_state",
    "update",
    "finalize",
    "merge_state",
    "online_softmax",
    "merge_normalized",
    "unstable_softmax",
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


def _causal_mask(sq: int, sk: int) -> np.ndarray:
    """Boolean (sq, sk) array, True where query i may see key j (bottom-right aligned: j <= i + sk - sq)."""
    i = np.arange(sq)[:, None]
    j = np.arange(sk)[None, :]
    return j <= i + (sk - sq)


def _scores_f64(q, k, scale, causal):
    """float64 scores ``scale * q @ k^T`` with masked entries set to -inf, batch axes broadcast."""
    q = np.asarray(q, dtype=np.float64)
    k = np.asarray(k, dtype=np.float64)
    if q.ndim < 2 or k.ndim < 2:
        raise ValueError("q and k need at least 2 dimensions (..., S, D)")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"head dims differ: q has D={q.shape[-1]}, k has D={k.shape[-1]}")
    d = q.shape[-1]
    if scale is None:
        scale = 1.0 / math.sqrt(d) if d > 0 else 1.0
    s = np.matmul(q, np.swapaxes(k, -1, -2)) * float(scale)
    if causal:
        s = np.where(_causal_mask(s.shape[-2], s.shape[-1]), s, -np.inf)
    return s


# ---------------------------------------------------------------------------------------------
# float64 truth
# ---------------------------------------------------------------------------------------------

def attention_ref(q, k, v, *, causal: bool = False, scale: Optional[float] = None):
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

    Returns
    -------
    o : ndarray, float64, shape (broadcast batch..., Sq, Dv)
    lse : ndarray, float64, shape (broadcast batch..., Sq)
        Natural-log log-sum-exp of the scaled, masked scores.  Rows that see no key (possible
        when ``causal`` and ``Sq > Sk``) give ``o = 0`` and ``lse = -inf``, without NaN or warnings;
        so does a row whose scores are all ``-inf``.  Otherwise NaN or inf in the inputs
        propagate as SciPy's softmax propagates them (a NaN or ``+inf`` score makes its row NaN).
    """
    v = np.asarray(v, dtype=np.float64)
    s = _scores_f64(q, k, scale, causal)
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
    p = softmax(s_safe, axis=-1)
    p = np.where(empty[..., None], 0.0, p)
    lse = logsumexp(s_safe, axis=-1)
    lse = np.where(empty, -np.inf, lse)
    o = np.matmul(p, v)
    return o, lse


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


def naive_attention(q, k, v, *, causal: bool = False, scale: Optional[float] = None, dtype,
                    precision: Optional[str] = None):
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
    if causal:
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

    o = rnd(np.matmul(op(p), op(vw)))
    return np.asarray(o, dtype=np.float64)


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
    qn = float(np.max(np.sqrt(np.sum(q * q, axis=-1))))
    kn = float(np.max(np.sqrt(np.sum(k * k, axis=-1))))
    vmax = float(np.max(np.abs(v)))
    u = unit_roundoff("float64")
    return u * vmax * (2.0 * (d + 1) * abs(float(scale)) * qn * kn + 2.0 * sk + 4.0)


def naive_error(q, k, v, *, causal=False, scale=None, dtype, o_ref=None,
                precision=None) -> float:
    """The max abs error, against the float64 reference, of the naive implementation in `dtype`.

    Measured (``naive_attention`` vs ``attention_ref``) for float16, bfloat16 and float32; for
    float64, where the reference is itself the naive float64 computation, the bound of
    :func:`naive_error_bound_f64`. NaN/inf entries of the reference are left out.
    """
    if _dtype_name(dtype) == "float64":
        return naive_error_bound_f64(q, k, v, scale=scale)
    if o_ref is None:
        o_ref, _ = attention_ref(q, k, v, causal=causal, scale=scale)
    diff = np.abs(naive_attention(q, k, v, causal=causal, scale=scale, dtype=dtype,
                                  precision=precision) - o_ref)
    diff = diff[np.isfinite(diff)]
    return float(diff.max()) if diff.size else 0.0


def output_scale(q, k, v, *, causal: bool = False, scale: Optional[float] = None) -> float:
    """``max_i,c sum_j softmax(s)_ij |v_jc|``: the size of the terms each output sums.

    It bounds ``max|o|`` and is the scale at which rounding the weights p and the output acts:
    where the weighted values cancel (a small ``|o|`` from large ``|v|``), any same-precision
    implementation carries an error of order ``u`` times this, not times ``|o|``.
    """
    o_abs, _ = attention_ref(q, k, np.abs(np.asarray(v, dtype=np.float64)), causal=causal,
                             scale=scale)
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


def pass_threshold(q, k, v, *, causal: bool = False, scale: Optional[float] = None, dtype,
                   o_ref=None, precision=None):
    """The rule in one call: ``(threshold, naive_err)`` for inputs q, k, v audited in `dtype`.

    ``threshold = 2 * naive_error + 4 * u(dtype) * output_scale``; see :func:`tolerance`.
    ``precision="high"`` (float32): the naive implementation is the one-pass TF32 one
    (:func:`naive_attention`), the counterpart of ``attention(..., precision="high")``.
    """
    if o_ref is None:
        o_ref, _ = attention_ref(q, k, v, causal=causal, scale=scale)
    ne = naive_error(q, k, v, causal=causal, scale=scale, dtype=dtype, o_ref=o_ref,
                     precision=precision)
    a = output_scale(q, k, v, causal=causal, scale=scale)
    return tolerance(dtype, o_ref, ne, out_scale=a), ne


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


def _probabilities_f64(q, k, v, causal, scale):
    """float64 (P, o, batch) with P = softmax of the masked scores, 0 on rows that see no key."""
    v = np.asarray(v, dtype=np.float64)
    s = _scores_f64(q, k, scale, causal)
    batch = np.broadcast_shapes(s.shape[:-2], v.shape[:-2])
    s = np.broadcast_to(s, batch + s.shape[-2:])
    empty = np.all(s == -np.inf, axis=-1)
    p = softmax(np.where(empty[..., None], 0.0, s), axis=-1)
    p = np.where(empty[..., None], 0.0, p)
    return p, np.matmul(p, v), batch


def _scale_or_default(scale, d):
    return 1.0 / math.sqrt(d) if scale is None else float(scale)


def attention_backward_ref(do, q, k, v, *, causal: bool = False, scale: Optional[float] = None):
    """Gradients of ``L = sum(do * attention(q, k, v))`` in float64, from SciPy's softmax.

    Parameters
    ----------
    do : array_like, shape (broadcast batch..., Sq, Dv)
        The upstream gradient dL/do.
    q : array_like, shape (..., Sq, D)
    k : array_like, shape (..., Sk, D)
    v : array_like, shape (..., Sk, Dv)
        Any real dtype (converted to float64); batch axes broadcast as in :func:`attention_ref`.
    causal, scale
        As in :func:`attention_ref`.

    Returns
    -------
    dq, dk, dv : ndarray, float64, the shapes of q, k and v
        Summed over the batch axes along which each input was broadcast. Rows that see no key
        contribute zero (never NaN).
    """
    q64, k64, v64 = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    scale = _scale_or_default(scale, q64.shape[-1])
    p, o, batch = _probabilities_f64(q64, k64, v64, causal, scale)
    do = np.broadcast_to(np.asarray(do, dtype=np.float64), batch + o.shape[-2:])
    dv = np.matmul(np.swapaxes(p, -1, -2), do)
    dp = np.matmul(do, np.swapaxes(v64, -1, -2))
    delta = np.sum(do * o, axis=-1, keepdims=True)
    ds = np.where(p > 0, p * (dp - delta), 0.0)
    dq = scale * np.matmul(ds, k64)
    dk = scale * np.matmul(np.swapaxes(ds, -1, -2), q64)
    return (_sum_to_shape(dq, q64.shape), _sum_to_shape(dk, k64.shape),
            _sum_to_shape(dv, v64.shape))


def attention_backward_fd(do, q, k, v, *, causal: bool = False, scale: Optional[float] = None,
                          eps: Optional[float] = None):
    """Gradients of ``L = sum(do * attention_ref(q, k, v)[0])`` by central finite differences.

    ``dL/dx = (L(x + h) - L(x - h)) / (2 h)`` for every element x of q, k and v, with
    ``h = eps * max(1, |x|)`` (default eps = 2^-18, near the cube root of float64's unit roundoff,
    where truncation and rounding errors balance). Two forward passes per element: for small
    cases only (a check of :func:`attention_backward_ref`).

    Returns
    -------
    dq, dk, dv : ndarray, float64, the shapes of q, k and v
    """
    q64, k64, v64 = (np.array(x, dtype=np.float64) for x in (q, k, v))
    scale = _scale_or_default(scale, q64.shape[-1])
    do = np.asarray(do, dtype=np.float64)
    eps = 2.0 ** -18 if eps is None else float(eps)
    arrays = [q64, k64, v64]

    def loss():
        o, _ = attention_ref(*arrays, causal=causal, scale=scale)
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


def naive_attention_backward(do, q, k, v, *, causal: bool = False, scale: Optional[float] = None,
                             dtype):
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
    causal, scale
        As in :func:`attention_ref`.
    dtype : {"float16", "bfloat16", "float32", "float64"}

    Returns
    -------
    dq, dk, dv : ndarray, float64, the shapes of q, k and v; values representable in ``dtype``.
    """
    name = _dtype_name(dtype)
    wd = np.float64 if name == "float64" else np.float32

    def rnd(x):
        if name in ("float32", "float64"):
            return np.asarray(x, dtype=wd)
        return round_to(np.asarray(x, dtype=np.float64), name).astype(wd)

    qw, kw, vw = (np.asarray(x, dtype=np.float64).astype(wd) for x in (q, k, v))
    scale = _scale_or_default(scale, qw.shape[-1])
    s = rnd(np.matmul(qw, np.swapaxes(kw, -1, -2)) * wd(scale))
    if causal:
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
    dq = rnd(np.matmul(ds, kw) * wd(scale))
    dk = rnd(np.matmul(np.swapaxes(ds, -1, -2), qw) * wd(scale))
    out = []
    for g, x in ((dq, qw), (dk, kw), (dv, vw)):
        summed = _sum_to_shape(g, x.shape)
        out.append(np.asarray(rnd(summed) if summed.shape != g.shape else g, dtype=np.float64))
    return tuple(out)


def gradient_scales(do, q, k, v, *, causal: bool = False, scale: Optional[float] = None):
    """``(A_dq, A_dk, A_dv)``: the size of the terms each element of dq, dk, dv sums.

    The backward run on magnitudes: ``A_dv = max (P^T |do|)``, ``A_dq = |scale| max (G |k|)``,
    ``A_dk = |scale| max (G^T |q|)`` with ``G = P * (|dP| + |delta|)``, the two terms of
    ``dS = P * (dP - delta)`` before they cancel (a single visible key gives dS = 0 from two equal
    rounded terms), summed over broadcast axes as the gradients are (they bound ``max|dv|``,
    ``max|dq|``, ``max|dk|``). As :func:`output_scale` for the forward, it is the scale at which
    the few roundings any same-precision backward makes act.
    """
    q64, k64, v64 = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    scale = _scale_or_default(scale, q64.shape[-1])
    p, o, batch = _probabilities_f64(q64, k64, v64, causal, scale)
    ado = np.abs(np.broadcast_to(np.asarray(do, dtype=np.float64), batch + o.shape[-2:]))
    dv = np.matmul(np.swapaxes(p, -1, -2), ado)
    do_ = np.broadcast_to(np.asarray(do, dtype=np.float64), batch + o.shape[-2:])
    dp = np.matmul(do_, np.swapaxes(v64, -1, -2))
    delta = np.sum(do_ * o, axis=-1, keepdims=True)
    dsm = np.where(p > 0, p * (np.abs(dp) + np.abs(delta)), 0.0)
    dq = abs(scale) * np.matmul(dsm, np.abs(k64))
    dk = abs(scale) * np.matmul(np.swapaxes(dsm, -1, -2), np.abs(q64))
    return tuple(float(np.max(_sum_to_shape(g, x.shape))) if g.size else 0.0
                 for g, x in ((dq, q64), (dk, k64), (dv, v64)))


def naive_gradient_error_bound_f64(do, q, k, v, *, causal: bool = False,
                                   scale: Optional[float] = None, scales=None):
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
        scales = gradient_scales(do, q, k, v, causal=causal, scale=scale)
    qn = float(np.max(np.sqrt(np.sum(q64 * q64, axis=-1))))
    kn = float(np.max(np.sqrt(np.sum(k64 * k64, axis=-1))))
    factor = 2.0 * (d + 1) * abs(scale) * qn * kn + 2.0 * (dv_dim + sq + sk) + 8.0
    u = unit_roundoff("float64")
    return tuple(u * a * factor for a in scales)


def _max_abs_diff(a, b):
    diff = np.abs(np.asarray(a, dtype=np.float64) - b)
    diff = diff[np.isfinite(diff)]
    return float(diff.max()) if diff.size else 0.0


def naive_gradient_errors(do, q, k, v, *, causal: bool = False, scale: Optional[float] = None,
                          dtype, ref=None, scales=None):
    """Max abs errors of :func:`naive_attention_backward` in ``dtype`` against the float64
    gradients, ``(dq, dk, dv)``; for float64 the bounds of
    :func:`naive_gradient_error_bound_f64`. ``ref``: :func:`attention_backward_ref`'s result."""
    if _dtype_name(dtype) == "float64":
        return naive_gradient_error_bound_f64(do, q, k, v, causal=causal, scale=scale,
                                              scales=scales)
    if ref is None:
        ref = attention_backward_ref(do, q, k, v, causal=causal, scale=scale)
    naive = naive_attention_backward(do, q, k, v, causal=causal, scale=scale, dtype=dtype)
    return tuple(_max_abs_diff(n, r) for n, r in zip(naive, ref))


def grad_pass_threshold(do, q, k, v, *, causal: bool = False, scale: Optional[float] = None,
                        dtype, ref=None):
    """The pass rule for gradients, one call: ``((tol_dq, tol_dk, tol_dv), (naive errors))``.

    Each gradient X gets the forward's rule (:func:`tolerance`): ``2 * naive_err_X +
    4 * u(dtype) * A_X``, with the naive same-precision backward's error
    (:func:`naive_gradient_errors`) and the terms' size ``A_X`` (:func:`gradient_scales`).
    ``ref``: :func:`attention_backward_ref`'s result for these inputs, if already computed.
    """
    if ref is None:
        ref = attention_backward_ref(do, q, k, v, causal=causal, scale=scale)
    scales = gradient_scales(do, q, k, v, causal=causal, scale=scale)
    errs = naive_gradient_errors(do, q, k, v, causal=causal, scale=scale, dtype=dtype, ref=ref,
                                 scales=scales)
    tols = tuple(tolerance(dtype, r, e, out_scale=a) for r, e, a in zip(ref, errs, scales))
    return tols, errs
