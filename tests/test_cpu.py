"""Tests of the NumPy tiled path, cuflash._cpu, against the float64 reference."""
import itertools
import math
import warnings
import zlib

import numpy as np
import pytest

from cuflash import reference as ref
from cuflash._cpu import attention_numpy, merge_states_numpy

U32 = 2.0 ** -24


SIZES = [1, 7, 113, 300]
HEAD_DIMS = [1, 16, 64, 130]
BLOCKS = [1, 16, 128]


def _seed(*parts):
    """A stable per-test seed derived from the test's parameters."""
    return zlib.crc32(repr(parts).encode())


def _inputs(rng, dtype, qshape, kshape, vshape):
    """Random inputs exactly representable in dtype, as arrays of that dtype (never all zeros)."""
    out = []
    for shape, scale in ((qshape, 1.5), (kshape, 1.0), (vshape, 1.0)):
        x = ref.round_to(rng.standard_normal(shape) * scale, dtype)
        out.append(x.astype(dtype))
    return out


def _check(qd, kd, vd, *, causal, block_k, scale=None, use_out=True):
    """Run attention_numpy and compare with attention_ref using the tolerance rule."""
    dt = qd.dtype.name
    q, k, v = (x.astype(np.float64) for x in (qd, kd, vd))
    d = q.shape[-1]
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    o_ref, lse_ref = ref.attention_ref(q, k, v, causal=causal, scale=scale)
    rule = ref.pass_threshold(q, k, v, causal=causal, scale=scale, dtype=dt, o_ref=o_ref,
                              key_tile=min(block_k, ref.MIN_KEY_TILE))

    out = np.full(o_ref.shape, np.nan, dtype=qd.dtype) if use_out else None
    o, lse = attention_numpy(qd, kd, vd, causal=causal, scale=scale, out=out, need_lse=True,
                             block_k=block_k)
    if use_out:
        assert o is out
    assert o.dtype == qd.dtype and o.shape == o_ref.shape
    assert not np.any(np.isnan(o)), "an output element was not written (or NaN was produced)"
    verdict = rule.judge(o)
    assert verdict.passed, "; ".join(verdict.reasons) + f" (naive error {rule.naive_err:.3g})"

    assert lse.dtype == np.float32 and lse.shape == lse_ref.shape
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_ref))
    fin = np.isfinite(lse_ref)
    # lse error: float32 rounding of lse and l, plus the worst-case error of the float32 dot
    # products q.k (D terms) for the narrow types.
    u_dot = 2.0 ** -53 if dt == "float64" else U32
    dot_bound = d * u_dot * scale * np.max(np.abs(q) @ np.swapaxes(np.abs(k), -1, -2), axis=-1)
    dot_bound = np.broadcast_to(dot_bound, lse_ref.shape)
    lse_tol = 4 * U32 * (1 + np.abs(lse_ref)) + dot_bound
    lse_err = np.abs(lse[fin].astype(np.float64) - lse_ref[fin])
    assert np.all(lse_err <= lse_tol[fin])
    return o, lse, o_ref, lse_ref


# Every (Sq, Sk) pair, both masks and all dtypes; head dims and tile sizes are cycled through
# the grid so that each D, each Dv != D and each block_k meets every Sq/Sk regime.
_MAIN_CASES = [
    (dt, sq, sk, causal, HEAD_DIMS[i % 4], HEAD_DIMS[(i + 1 + i // 4) % 4] + (i % 3), BLOCKS[i % 3])
    for i, (dt, (sq, sk), causal) in enumerate(itertools.product(
        ["float16", "float32", "float64"], itertools.product(SIZES, SIZES), [False, True]))
]


@pytest.mark.parametrize("dt,sq,sk,causal,d,dv,block_k", _MAIN_CASES)
def test_matches_reference(dt, sq, sk, causal, d, dv, block_k):
    rng = np.random.default_rng(_seed("main", dt, sq, sk, causal, d, dv, block_k))
    q, k, v = _inputs(rng, dt, (2, 3, sq, d), (2, 3, sk, d), (2, 3, sk, dv))
    _check(q, k, v, causal=causal, block_k=block_k, use_out=bool(sq % 2))


@pytest.mark.parametrize("dt", ["float16", "float32", "float64"])
@pytest.mark.parametrize("d,dv", [(d, dv) for d in HEAD_DIMS for dv in HEAD_DIMS])
def test_head_dims(dt, d, dv):
    rng = np.random.default_rng(_seed("dims", dt, d, dv))
    q, k, v = _inputs(rng, dt, (2, 33, d), (2, 47, d), (2, 47, dv))
    _check(q, k, v, causal=bool((d + dv) % 3), block_k=16)


@pytest.mark.parametrize("dt", ["float16", "float32", "float64"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("block_k", BLOCKS)
def test_block_k(dt, causal, block_k):
    rng = np.random.default_rng(_seed("block", dt, causal, block_k))
    q, k, v = _inputs(rng, dt, (2, 113, 64), (2, 300, 64), (2, 300, 40))
    _check(q, k, v, causal=causal, block_k=block_k)


@pytest.mark.parametrize("causal", [False, True])
def test_block_k_does_not_change_the_answer(causal):
    rng = np.random.default_rng(_seed("block-invariance", causal))
    q, k, v = _inputs(rng, "float64", (3, 57, 32), (3, 201, 32), (3, 201, 8))
    results = [attention_numpy(q, k, v, causal=causal, scale=0.2, out=None, need_lse=True,
                               block_k=b) for b in (1, 7, 16, 128, 1000)]
    for o, lse in results[1:]:
        np.testing.assert_allclose(o, results[0][0], rtol=0, atol=1e-13)
        np.testing.assert_allclose(lse, results[0][1], rtol=1e-6)


@pytest.mark.parametrize("dt", ["float16", "float32", "float64"])
@pytest.mark.parametrize("qb,kb", [
    ((2, 4), (2, 1)),      # multi-query: one k/v head shared by 4 query heads
    ((1, 4), (3, 1)),      # both sides broadcast
    ((4,), (3, 1)),        # different ranks
    ((2, 4), ()),          # 2-D k/v shared by every batch and head
])
@pytest.mark.parametrize("causal", [False, True])
def test_batch_broadcast(dt, qb, kb, causal):
    rng = np.random.default_rng(_seed("bcast", dt, qb, kb, causal))
    q, k, v = _inputs(rng, dt, qb + (19, 16), kb + (23, 16), kb + (23, 12))
    o, lse, _, _ = _check(q, k, v, causal=causal, block_k=16)
    assert o.shape == np.broadcast_shapes(qb, kb) + (19, 12)
    assert lse.shape == np.broadcast_shapes(qb, kb) + (19,)


@pytest.mark.parametrize("dt", ["float16", "float32", "float64"])
@pytest.mark.parametrize("causal", [False, True])
def test_two_dimensional(dt, causal):
    rng = np.random.default_rng(_seed("2d", dt, causal))
    q, k, v = _inputs(rng, dt, (40, 16), (29, 16), (29, 9))
    o, lse, _, _ = _check(q, k, v, causal=causal, block_k=16)
    assert o.shape == (40, 9) and lse.shape == (40,)


@pytest.mark.parametrize("dt", ["float16", "float32", "float64"])
@pytest.mark.parametrize("causal", [False, True])
def test_non_contiguous_inputs_and_out(dt, causal):
    rng = np.random.default_rng(_seed("strides", dt, causal))
    b, h, sq, sk, d, dv = 2, 3, 37, 53, 24, 10
    # (B, S, H, D) storage viewed as (B, H, S, D), as a model's projection output usually is.
    q = ref.round_to(rng.standard_normal((b, sq, h, d)), dt).astype(dt).transpose(0, 2, 1, 3)
    # Last axis not contiguous: stored as (B, H, D, S) and swapped.
    k = ref.round_to(rng.standard_normal((b, h, d, sk)), dt).astype(dt).swapaxes(-1, -2)
    # Every other element of a wider array.
    v = ref.round_to(rng.standard_normal((b, h, sk, 2 * dv)), dt).astype(dt)[..., ::2]
    assert not (q.flags.c_contiguous or k.flags.c_contiguous or v.flags.c_contiguous)
    o, lse, o_ref, _ = _check(q, k, v, causal=causal, block_k=16)
    # A non-contiguous out buffer is written in full too.
    out = np.full((b, sq, h, dv), np.nan, dtype=dt).transpose(0, 2, 1, 3)
    o2, _ = attention_numpy(q, k, v, causal=causal, scale=1 / math.sqrt(d), out=out,
                            need_lse=False, block_k=16)
    assert o2 is out and not np.any(np.isnan(out))
    np.testing.assert_array_equal(out, o)


@pytest.mark.parametrize("dt", ["float16", "float32", "float64"])
@pytest.mark.parametrize("sq,sk", [(300, 113), (7, 1), (113, 7), (300, 299)])
def test_fully_masked_rows(dt, sq, sk):
    rng = np.random.default_rng(_seed("masked", dt, sq, sk))
    q, k, v = _inputs(rng, dt, (2, 2, sq, 16), (2, 2, sk, 16), (2, 2, sk, 8))
    out = np.full((2, 2, sq, 8), np.nan, dtype=dt)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with np.errstate(divide="raise", invalid="raise", over="raise"):
            o, lse = attention_numpy(q, k, v, causal=True, scale=0.25, out=out, need_lse=True,
                                     block_k=16)
    masked = sq - sk
    assert np.all(o[..., :masked, :] == 0)
    assert np.all(lse[..., :masked] == -np.inf)
    assert np.all(np.isfinite(o)) and np.all(np.isfinite(lse[..., masked:]))
    _check(q, k, v, causal=True, block_k=16, scale=0.25)


def test_need_lse_false_and_return_dtype():
    rng = np.random.default_rng(_seed("nolse"))
    q, k, v = _inputs(rng, "float16", (2, 9, 8), (2, 9, 8), (2, 9, 8))
    o, lse = attention_numpy(q, k, v, causal=False, scale=0.3, out=None, need_lse=False)
    assert lse is None and o.dtype == np.float16 and o.shape == (2, 9, 8)


def test_nan_and_inf_propagate():
    rng = np.random.default_rng(_seed("nan"))
    q, k, v = _inputs(rng, "float32", (1, 10, 8), (1, 10, 8), (1, 10, 4))
    v[0, 3, 1] = np.nan
    q[0, 6, 0] = np.nan
    with np.errstate(invalid="ignore"):
        o, lse = attention_numpy(q, k, v, causal=True, scale=0.3, out=None, need_lse=True)
    # Key 3 is seen by rows >= 3 (Sq == Sk): their column 1 is NaN; rows 0..2 do not see it, and a
    # masked key touches no row (tests/test_nonfinite.py has the full set of cases).
    assert np.all(np.isnan(o[0, 3:, 1])) and np.all(np.isfinite(o[0, :3, 1]))
    # Row 6 has a NaN query: all of it is NaN, and so is its lse; other rows keep finite lse
    # and finite values in the columns without NaN.
    assert np.all(np.isnan(o[0, 6])) and np.isnan(lse[0, 6])
    assert np.all(np.isfinite(np.delete(lse[0], 6)))
    assert np.all(np.isfinite(np.delete(o[0, :, [0, 2, 3]], 6, axis=1)))
    # An infinite value reaches the rows that see it as a non-finite output.
    v2 = v.copy()
    v2[0, 3, 1] = np.inf
    with np.errstate(invalid="ignore"):
        o2, _ = attention_numpy(q, k, v2, causal=True, scale=0.3, out=None, need_lse=False,
                                block_k=2)
    assert np.all(np.isposinf(np.delete(o2[0, 3:, 1], 3)))


@pytest.mark.parametrize("dt", ["float16", "float32", "float64"])
@pytest.mark.parametrize("split", [0.5, 0.1])
def test_merge_two_halves_equals_full(dt, split):
    rng = np.random.default_rng(_seed("merge", dt, split))
    sq, sk, d, dv = 45, 130, 32, 20
    q, k, v = _inputs(rng, dt, (2, 3, sq, d), (2, 3, sk, d), (2, 3, sk, dv))
    cut = int(sk * split)
    kw = dict(causal=False, scale=1 / math.sqrt(d), out=None, need_lse=True, block_k=32)
    o_a, lse_a = attention_numpy(q, k[..., :cut, :], v[..., :cut, :], **kw)
    o_b, lse_b = attention_numpy(q, k[..., cut:, :], v[..., cut:, :], **kw)
    o, lse = merge_states_numpy(o_a, lse_a, o_b, lse_b)
    assert o.dtype == np.dtype(dt) and lse.dtype == np.float32

    q64, k64, v64 = (x.astype(np.float64) for x in (q, k, v))
    o_ref, lse_ref = ref.attention_ref(q64, k64, v64)
    rule = ref.pass_threshold(q64, k64, v64, dtype=dt, o_ref=o_ref)
    # Extra terms: the halves are each rounded to dt before the merge (2 u max|o|), and the merge
    # weights exp(lse_part - lse) come from float32 lse values, so they carry a relative error
    # of about 2 u32 |lse| (which dominates for float64 outputs).
    o_max = max(np.max(np.abs(o_a.astype(np.float64))), np.max(np.abs(o_b.astype(np.float64))))
    lse_max = max(np.max(np.abs(lse_a)), np.max(np.abs(lse_b)))
    extra = 2 * ref.unit_roundoff(dt) * np.max(np.abs(o_ref)) + 4 * U32 * (1 + lse_max) * o_max
    verdict = rule.widened(extra).judge(o)
    assert verdict.passed, verdict.reasons
    np.testing.assert_allclose(lse, lse_ref, rtol=2e-6, atol=1e-5)
    o_full, lse_full = attention_numpy(q, k, v, **kw)
    np.testing.assert_allclose(lse, lse_full, rtol=2e-6, atol=1e-6)


def test_merge_with_empty_parts():
    rng = np.random.default_rng(_seed("merge-empty"))
    o_a = rng.standard_normal((3, 5, 4)).astype(np.float32)
    lse_a = rng.standard_normal((3, 5)).astype(np.float32)
    lse_a[1, 2] = -np.inf
    o_a[1, 2] = 0
    o_e, lse_e = np.zeros_like(o_a), np.full_like(lse_a, -np.inf)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with np.errstate(divide="raise", invalid="raise", over="raise"):
            o, lse = merge_states_numpy(o_a, lse_a, o_e, lse_e)
            o2, lse2 = merge_states_numpy(o_e, lse_e, o_a, lse_a)
            o3, lse3 = merge_states_numpy(o_e, lse_e, o_e, lse_e)
    np.testing.assert_array_equal(o, o_a)
    np.testing.assert_array_equal(lse, lse_a)
    np.testing.assert_array_equal(o2, o_a)
    np.testing.assert_array_equal(lse2, lse_a)
    assert np.all(o3 == 0) and np.all(lse3 == -np.inf)


def test_merge_matches_reference_merge():
    rng = np.random.default_rng(_seed("merge-ref"))
    o_a, o_b = rng.standard_normal((2, 4, 6, 3))
    lse_a, lse_b = rng.standard_normal((2, 4, 6)) * 5
    o, lse = merge_states_numpy(o_a, lse_a, o_b, lse_b)
    o_r, lse_r = ref.merge_normalized(o_a, lse_a, o_b, lse_b)
    assert o.dtype == np.float64
    np.testing.assert_allclose(o, o_r, rtol=0, atol=1e-6)
    np.testing.assert_allclose(lse, lse_r, rtol=1e-6)


def test_bfloat16_inputs():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    bf16 = np.dtype(ml_dtypes.bfloat16)
    rng = np.random.default_rng(_seed("bf16"))
    for causal in (False, True):
        q, k, v = (ref.round_to(rng.standard_normal(s), "bfloat16").astype(bf16)
                   for s in ((2, 70, 32), (2, 90, 32), (2, 90, 16)))
        _check(q, k, v, causal=causal, block_k=16)
