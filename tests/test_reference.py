"""Tests of cuflash.reference: the recurrence, the merge operator, the float64 truth, rounding."""
import math
import warnings

import numpy as np
import pytest
from scipy.special import logsumexp, softmax

from cuflash import reference as ref


@pytest.fixture
def strict_fp():
    """Turn NumPy floating-point warnings (NaN creation, overflow, divide by zero) into errors."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with np.errstate(divide="raise", invalid="raise", over="raise"):
            yield


def _random_partition(rng, n):
    """A random partition of range(n) into index arrays (not contiguous), in random order."""
    nchunks = int(rng.integers(1, n + 1))
    labels = rng.integers(0, nchunks, size=n)
    return [np.flatnonzero(labels == c) for c in range(nchunks) if np.any(labels == c)]


def _random_sizes(rng, n):
    cuts = np.sort(rng.choice(np.arange(1, n), size=int(rng.integers(0, n)), replace=False))
    return np.diff(np.concatenate([[0], cuts, [n]])).tolist()


# ---------------------------------------------------------------------------------------------
# the recurrence
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(8))
def test_recurrence_matches_scipy_any_chunking_and_order(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 80))
    s = rng.standard_normal((3, 4, n)) * rng.uniform(0.5, 20.0)
    v = rng.standard_normal((n, 7))
    expected = softmax(s, axis=-1) @ v
    expected_lse = logsumexp(s, axis=-1)

    sizes = _random_sizes(rng, n)
    parts = _random_partition(rng, n)
    for chunks in (sizes, parts, int(rng.integers(1, n + 1))):
        nchunks = len(ref._chunk_indices(chunks, n))
        for order in (None, rng.permutation(nchunks)):
            o, lse = ref.online_softmax(s, v, chunks, order=order)
            assert o.dtype == np.float64
            np.testing.assert_allclose(o, expected, rtol=0, atol=1e-12)
            np.testing.assert_allclose(lse, expected_lse, rtol=1e-13, atol=1e-12)


@pytest.mark.parametrize("seed", range(3))
def test_recurrence_with_per_row_values(seed):
    rng = np.random.default_rng(100 + seed)
    s = rng.standard_normal((5, 30)) * 4
    v = rng.standard_normal((5, 30, 3))
    o, lse = ref.online_softmax(s, v, [7, 13, 10], order=[2, 0, 1])
    expected = np.einsum("rn,rnd->rd", softmax(s, axis=-1), v)
    np.testing.assert_allclose(o, expected, rtol=0, atol=1e-12)
    np.testing.assert_allclose(lse, logsumexp(s, axis=-1), rtol=1e-13)


def test_worked_example_ones():
    s = np.array([1.0, 2.0, 3.0, 10.0])
    v = np.ones((4, 1))
    o, lse, hist = ref.online_softmax(s, v, [2, 2], return_history=True)
    first, second = hist
    assert first.m == 2.0
    assert first.l == pytest.approx(1.367879, abs=5e-7)
    assert first.O[0] == pytest.approx(1.367879, abs=5e-7)
    assert second.m == 10.0
    assert second.l == pytest.approx(1.0013708, abs=5e-8)
    assert second.O[0] == pytest.approx(1.0013708, abs=5e-8)
    assert o[0] == pytest.approx(1.0, abs=1e-15)
    assert lse == pytest.approx(10.0 + math.log(1.0013708), abs=1e-7)
    # The rescale factor of the documented example, and the softmax it implies.
    alpha = math.exp(first.m - second.m)
    assert alpha == pytest.approx(3.35e-4, abs=5e-7)
    assert alpha * first.l == pytest.approx(4.58e-4, abs=5e-6)  # the rescaled l (and O)
    np.testing.assert_allclose(np.exp(s - lse), [1.2324e-4, 3.3500e-4, 9.1063e-4, 0.998631],
                               rtol=1e-4)


def test_worked_example_ones_reversed_order():
    s = np.array([1.0, 2.0, 3.0, 10.0])
    v = np.ones((4, 1))
    o, lse, hist = ref.online_softmax(s, v, [2, 2], order=[1, 0], return_history=True)
    # m is 10 from the first processed chunk on, so no rescale ever happens (alpha = 1).
    assert hist[0].m == 10.0 and hist[1].m == 10.0
    assert hist[0].l == pytest.approx(1.0 + math.exp(-7.0), abs=1e-15)
    assert hist[1].l == pytest.approx(1.0013708, abs=5e-8)
    forward = ref.online_softmax(s, v, [2, 2], return_history=True)
    assert hist[1].l == pytest.approx(forward[2][1].l, abs=1e-15)
    assert o[0] == pytest.approx(forward[0][0], abs=1e-15)


def test_worked_example_two_values():
    s = np.array([0.0, 5.0])
    v = np.array([[2.0], [3.0]])
    o, lse, hist = ref.online_softmax(s, v, [[0], [1]], return_history=True)
    assert (hist[0].m, hist[0].l, hist[0].O[0]) == (0.0, 1.0, 2.0)
    assert hist[1].m == 5.0
    assert hist[1].l == pytest.approx(1.0067379, abs=5e-8)
    assert hist[1].O[0] == pytest.approx(3.0134759, abs=5e-8)
    assert o[0] == pytest.approx(2.993307, abs=5e-7)
    assert o[0] == pytest.approx(3.0 - 1.0 / (1.0 + math.exp(5.0)), abs=1e-14)


def test_update_and_finalize_step_by_step():
    st = ref.init_state((), 1)
    assert st.m == -np.inf and st.l == 0.0 and st.O.tolist() == [0.0]
    st = ref.update(st, [1.0, 2.0], np.ones((2, 1)))
    assert st.m == 2.0 and st.l == pytest.approx(1.0 + math.exp(-1.0), abs=1e-15)
    st = ref.update(st, [3.0, 10.0], np.ones((2, 1)))
    o, lse = ref.finalize(st)
    assert o[0] == pytest.approx(1.0, abs=1e-15)
    assert lse == pytest.approx(logsumexp([1.0, 2.0, 3.0, 10.0]), abs=1e-14)


def test_empty_rows_stay_empty(strict_fp):
    st = ref.init_state((3,), 2)
    st = ref.update(st, np.full((3, 4), -np.inf), np.ones((4, 2)))
    assert np.all(st.m == -np.inf) and np.all(st.l == 0) and np.all(st.O == 0)
    o, lse = ref.finalize(st)
    assert np.all(o == 0) and np.all(lse == -np.inf)
    # A row masked in the first chunk and visible in the second is handled normally.
    st = ref.update(st, np.array([[0.0, -np.inf], [-np.inf, -np.inf], [1.0, 2.0]]), np.ones((2, 2)))
    o, lse = ref.finalize(st)
    np.testing.assert_allclose(o, [[1, 1], [0, 0], [1, 1]], atol=1e-15)
    assert lse[1] == -np.inf and lse[0] == 0.0


def test_chunk_spec_validation():
    s, v = np.zeros(5), np.ones((5, 1))
    with pytest.raises(ValueError):
        ref.online_softmax(s, v, [2, 2])
    with pytest.raises(ValueError):
        ref.online_softmax(s, v, [[0, 1], [1, 2, 3, 4]])
    with pytest.raises(ValueError):
        ref.online_softmax(s, v, [2, 3], order=[0, 0])


# ---------------------------------------------------------------------------------------------
# merge
# ---------------------------------------------------------------------------------------------

def _random_state(rng, rows, dv, empty_rows=()):
    st = ref.init_state(rows, dv)
    for _ in range(int(rng.integers(1, 4))):
        c = int(rng.integers(1, 6))
        st = ref.update(st, rng.standard_normal(rows + (c,)) * 8 + rng.uniform(-30, 30),
                        rng.standard_normal((c, dv)))
    for r in empty_rows:
        st.m[r], st.l[r], st.O[r] = -np.inf, 0.0, 0.0
    return st


def _assert_states_close(a, b, tol=1e-12):
    oa, la = ref.finalize(a)
    ob, lb = ref.finalize(b)
    np.testing.assert_array_equal(np.isneginf(la), np.isneginf(lb))
    np.testing.assert_allclose(oa, ob, rtol=0, atol=tol)
    fin = np.isfinite(la)
    np.testing.assert_allclose(la[fin], lb[fin], rtol=tol, atol=tol)


@pytest.mark.parametrize("seed", range(5))
def test_merge_state_associative_commutative_identity(seed, strict_fp):
    rng = np.random.default_rng(200 + seed)
    rows, dv = (6,), 4
    a = _random_state(rng, rows, dv, empty_rows=[0])
    b = _random_state(rng, rows, dv, empty_rows=[0, 1])
    c = _random_state(rng, rows, dv, empty_rows=[0, 2])
    e = ref.init_state(rows, dv)

    _assert_states_close(ref.merge_state(a, b), ref.merge_state(b, a))
    _assert_states_close(ref.merge_state(ref.merge_state(a, b), c),
                         ref.merge_state(a, ref.merge_state(b, c)))
    for x in (a, b, c):
        _assert_states_close(ref.merge_state(x, e), x, tol=0)
        _assert_states_close(ref.merge_state(e, x), x, tol=0)
    ee = ref.merge_state(e, e)
    assert np.all(ee.m == -np.inf) and np.all(ee.l == 0) and np.all(ee.O == 0)
    abc = ref.merge_state(ref.merge_state(a, b), c)
    o, lse = ref.finalize(abc)
    assert o[0].tolist() == [0.0] * dv and lse[0] == -np.inf


@pytest.mark.parametrize("seed", range(4))
def test_merge_of_disjoint_parts_equals_whole(seed):
    rng = np.random.default_rng(300 + seed)
    s = rng.standard_normal((4, 50)) * 10
    v = rng.standard_normal((50, 3))
    parts = _random_partition(rng, 50)
    states = []
    for ix in parts:
        st = ref.update(ref.init_state((4,), 3), s[:, ix], v[ix])
        states.append(st)
    total = states[0]
    for st in states[1:]:
        total = ref.merge_state(total, st)
    o, lse = ref.finalize(total)
    np.testing.assert_allclose(o, softmax(s, axis=-1) @ v, atol=1e-12)
    np.testing.assert_allclose(lse, logsumexp(s, axis=-1), rtol=1e-13)

    # The same with normalised results.
    finals = [ref.finalize(st) for st in states]
    o2, lse2 = finals[0]
    for oi, li in finals[1:]:
        o2, lse2 = ref.merge_normalized(o2, lse2, oi, li)
    np.testing.assert_allclose(o2, o, atol=1e-12)
    np.testing.assert_allclose(lse2, lse, rtol=1e-13)


@pytest.mark.parametrize("seed", range(4))
def test_merge_normalized_properties(seed, strict_fp):
    rng = np.random.default_rng(400 + seed)
    parts = []
    for empty in (0, 1, 2):
        o, lse = ref.finalize(_random_state(rng, (5,), 3, empty_rows=[empty, 4]))
        parts.append((o, lse))
    (oa, la), (ob, lb), (oc, lc) = parts
    ab = ref.merge_normalized(oa, la, ob, lb)
    ba = ref.merge_normalized(ob, lb, oa, la)
    np.testing.assert_allclose(ab[0], ba[0], atol=1e-12)
    np.testing.assert_array_equal(ab[1], ba[1])
    left = ref.merge_normalized(*ab, oc, lc)
    right = ref.merge_normalized(oa, la, *ref.merge_normalized(ob, lb, oc, lc))
    np.testing.assert_allclose(left[0], right[0], atol=1e-12)
    fin = np.isfinite(left[1])
    np.testing.assert_allclose(left[1][fin], right[1][fin], rtol=1e-13)
    assert left[1][4] == -np.inf and np.all(left[0][4] == 0)
    zero, ninf = np.zeros_like(oa), np.full_like(la, -np.inf)
    o_id, l_id = ref.merge_normalized(oa, la, zero, ninf)
    np.testing.assert_allclose(o_id, oa, atol=1e-15)
    np.testing.assert_array_equal(l_id, la)


# ---------------------------------------------------------------------------------------------
# overflow and underflow
# ---------------------------------------------------------------------------------------------

def test_unstable_softmax_overflows_in_float16_but_recurrence_does_not():
    # exp(11) = 59874 fits in float16 (max 65504); exp(11.2) = 73130 does not.
    assert np.all(np.isfinite(ref.unstable_softmax([11.0], np.float16)))
    assert not np.all(np.isfinite(ref.unstable_softmax([11.2], np.float16)))

    rng = np.random.default_rng(7)
    s = (rng.standard_normal((4, 40)) * 3 + np.array([[0.0], [12.0], [20.0], [60.0]])).astype(np.float16)
    v = rng.standard_normal((40, 5)).astype(np.float16)
    bad = ref.unstable_softmax(s, np.float16)
    assert bad.dtype == np.float16
    assert np.all(np.isfinite(bad[0]))
    for r in (1, 2, 3):
        assert not np.all(np.isfinite(bad[r]))

    o, lse = ref.online_softmax(s, v, 8, state_dtype=np.float32)
    assert o.dtype == np.float32 and np.all(np.isfinite(o)) and np.all(np.isfinite(lse))
    s64, v64 = s.astype(np.float64), v.astype(np.float64)
    np.testing.assert_allclose(o, softmax(s64, axis=-1) @ v64, atol=1e-5)
    np.testing.assert_allclose(lse, logsumexp(s64, axis=-1), rtol=1e-6)
    # The default working precision for float16 scores is float32.
    assert ref.online_softmax(s, v, 8)[0].dtype == np.float32


@pytest.mark.parametrize("dtype,jump", [(np.float32, 250.0), (np.float64, 1000.0)])
def test_alpha_underflow(dtype, jump, strict_fp):
    # The max jumps by more than the exponent range, so alpha = exp(m_old - m_new) flushes to 0:
    # the first chunk's contributions vanish, which is the right answer to working precision.
    with np.errstate(under="ignore"):
        assert np.exp(dtype(-jump)) == 0
    rng = np.random.default_rng(11)
    s = np.concatenate([rng.standard_normal(6), jump + rng.standard_normal(5)])
    v = rng.standard_normal((11, 3))
    with np.errstate(under="ignore"):
        o, lse = ref.online_softmax(s, v, [6, 5], state_dtype=dtype)
    expected = softmax(s) @ v
    atol = 1e-12 if dtype is np.float64 else 1e-5
    np.testing.assert_allclose(o, expected, atol=atol)
    np.testing.assert_allclose(lse, logsumexp(s), rtol=1e-6 if dtype is np.float32 else 1e-14)


# ---------------------------------------------------------------------------------------------
# attention_ref, naive_attention, tolerance
# ---------------------------------------------------------------------------------------------

def _direct_attention(q, k, v, causal, scale):
    """Row-by-row float64 attention written out with math.exp (independent of SciPy).

    q, k, v must already share their batch shape.
    """
    sq, sk = q.shape[-2], k.shape[-2]
    o = np.zeros(q.shape[:-1] + (v.shape[-1],))
    lse = np.full(q.shape[:-1], -np.inf)
    for b in np.ndindex(q.shape[:-2]):
        for i in range(sq):
            js = [j for j in range(sk) if not causal or j <= i + sk - sq]
            if not js:
                continue
            sc = [scale * float(np.dot(q[b + (i,)], k[b + (j,)])) for j in js]
            mx = max(sc)
            w = [math.exp(x - mx) for x in sc]
            tot = math.fsum(w)
            o[b + (i,)] = sum(wj * v[b + (j,)] for wj, j in zip(w, js)) / tot
            lse[b + (i,)] = mx + math.log(tot)
    return o, lse


def _batch_shapes_and_broadcast(q, k, v):
    batch = np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    return (np.broadcast_to(q, batch + q.shape[-2:]), np.broadcast_to(k, batch + k.shape[-2:]),
            np.broadcast_to(v, batch + v.shape[-2:]))


@pytest.mark.parametrize("sq,sk,causal,qb,kb", [
    (5, 9, False, (2, 3), (2, 3)),
    (5, 9, True, (2, 3), (2, 3)),     # Sq < Sk
    (9, 5, True, (2, 3), (2, 3)),     # Sq > Sk: the first 4 rows see no key
    (6, 6, True, (2, 4), (2, 1)),     # multi-query: k/v head axis of size 1
    (4, 7, True, (3,), (2, 1)),       # batch axes broadcast across ranks
    (3, 8, True, (), ()),             # 2-D
])
def test_attention_ref_matches_direct_formula(sq, sk, causal, qb, kb, strict_fp):
    rng = np.random.default_rng(500 + sq * 10 + sk)
    d, dv = 6, 4
    q = rng.standard_normal(qb + (sq, d)) * 2
    k = rng.standard_normal(kb + (sk, d))
    v = rng.standard_normal(kb + (sk, dv))
    for scale in (None, 0.7):
        o, lse = ref.attention_ref(q, k, v, causal=causal, scale=scale)
        qq, kk, vv = _batch_shapes_and_broadcast(q, k, v)
        o2, lse2 = _direct_attention(qq, kk, vv, causal, 1 / math.sqrt(d) if scale is None else scale)
        assert o.shape == o2.shape and lse.shape == lse2.shape
        np.testing.assert_allclose(o, o2, rtol=0, atol=1e-13)
        np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse2))
        np.testing.assert_allclose(lse, lse2, rtol=1e-13)
    if causal and sq > sk:
        masked = sq - sk
        assert np.all(o[..., :masked, :] == 0) and np.all(lse[..., :masked] == -np.inf)
        assert np.all(np.isfinite(lse[..., masked:]))


def test_attention_ref_propagates_nan():
    rng = np.random.default_rng(9)
    q, k, v = rng.standard_normal((4, 3)), rng.standard_normal((5, 3)), rng.standard_normal((5, 2))
    v[2, 0] = np.nan
    with np.errstate(invalid="ignore"):
        o, _ = ref.attention_ref(q, k, v)
    assert np.all(np.isnan(o[:, 0])) and np.all(np.isfinite(o[:, 1]))


@pytest.mark.parametrize("causal,sq,sk", [(False, 7, 11), (True, 7, 11), (True, 11, 7)])
def test_naive_float64_equals_reference(causal, sq, sk):
    rng = np.random.default_rng(600 + sq)
    q, k, v = (rng.standard_normal((2, n, d)) for n, d in ((sq, 16), (sk, 16), (sk, 9)))
    o = ref.naive_attention(q, k, v, causal=causal, dtype="float64")
    np.testing.assert_allclose(o, ref.attention_ref(q, k, v, causal=causal)[0], rtol=0, atol=1e-12)


@pytest.mark.parametrize("dtype,bound", [("float16", 5e-3), ("bfloat16", 4e-2), ("float32", 1e-6)])
def test_naive_low_precision(dtype, bound):
    rng = np.random.default_rng(700)
    q, k, v = (ref.round_to(rng.standard_normal(shape), dtype)
               for shape in ((2, 9, 32), (2, 12, 32), (2, 12, 8)))
    o = ref.naive_attention(q, k, v, causal=True, dtype=dtype)
    np.testing.assert_array_equal(ref.round_to(o, dtype), o)  # representable in dtype
    o_ref = ref.attention_ref(q, k, v, causal=True)[0]
    err = np.max(np.abs(o - o_ref))
    assert 0 < err < bound
    # Sq > Sk: fully masked rows give 0.
    o2 = ref.naive_attention(q, k[:, :4], v[:, :4], causal=True, dtype=dtype)
    assert np.all(o2[:, :5] == 0) and np.all(np.isfinite(o2))


def test_tolerance_formula():
    o_ref = np.array([[0.5, -2.0], [1.0, 0.25]])
    assert ref.tolerance("float16", o_ref, 1e-3) == 2e-3 + 4 * 2.0 ** -11 * 2.0
    assert ref.tolerance("bfloat16", o_ref, 0.0) == 4 * 2.0 ** -8 * 2.0
    assert ref.tolerance(np.float32, o_ref, 1e-7) == 2e-7 + 4 * 2.0 ** -24 * 2.0
    assert ref.tolerance(np.dtype("float64"), o_ref, 0.0) == 4 * 2.0 ** -53 * 2.0


# ---------------------------------------------------------------------------------------------
# round_to
# ---------------------------------------------------------------------------------------------

BF16_CASES = [
    (1.0, 1.0),
    (1.0 + 2.0 ** -8, 1.0),                                  # tie -> even (down)
    (1.0 + 3 * 2.0 ** -8, 1.0 + 2.0 ** -6),                  # tie -> even (up)
    (1.0 + 2.0 ** -8 + 2.0 ** -30, 1.0 + 2.0 ** -7),         # just above a tie (no double rounding)
    (1.0 + 2.0 ** -8 - 2.0 ** -40, 1.0),                     # just below a tie
    (3.14159, 3.140625),
    (-3.14159, -3.140625),
    (0.1, 0.10009765625),
    (3.39e38, 3.3895313892515355e38),                        # largest finite bfloat16
    (3.4e38, np.inf),                                        # past the halfway point -> inf
    (1e-45, 0.0),
    (np.inf, np.inf),
    (-np.inf, -np.inf),
]


@pytest.mark.parametrize("x,expected", BF16_CASES)
def test_round_to_bfloat16_known_values(x, expected):
    assert ref.round_to(x, "bfloat16") == expected
    assert ref.round_to(np.array([x]), "bfloat16")[0] == expected


def test_round_to_bfloat16_nan_and_shape():
    x = np.array([[np.nan, 1.5], [-np.nan, 2.0]])
    r = ref.round_to(x, "bfloat16")
    assert r.shape == x.shape and r.dtype == np.float64
    assert np.isnan(r[0, 0]) and np.isnan(r[1, 0]) and r[0, 1] == 1.5 and r[1, 1] == 2.0


def test_round_to_bfloat16_against_ml_dtypes():
    # ml_dtypes converts float64 -> float32 -> bfloat16 (two roundings), so compare on values
    # that are exact in float32, where its answer is the correctly rounded one: random bit
    # patterns cover normals, subnormals, ties and the overflow boundary.
    ml_dtypes = pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(800)
    bits = rng.integers(0, 2 ** 32, size=200000, dtype=np.uint64).astype(np.uint32)
    ties = (rng.integers(0, 2 ** 16, size=20000, dtype=np.uint64).astype(np.uint32) << 16) | 0x8000
    x32 = np.concatenate([bits, ties]).view(np.float32)
    x = x32[~np.isnan(x32)].astype(np.float64)
    expected = x.astype(ml_dtypes.bfloat16).astype(np.float64)
    np.testing.assert_array_equal(ref.round_to(x, "bfloat16"), expected)


def test_round_to_other_dtypes():
    assert ref.round_to(1.0 + 2.0 ** -11, "float16") == 1.0
    assert ref.round_to(1.0 + 3 * 2.0 ** -11, "float16") == 1.0 + 2.0 ** -9
    assert ref.round_to(70000.0, "float16") == np.inf
    assert ref.round_to(1.0 + 2.0 ** -24, "float32") == 1.0
    assert ref.round_to(1.0 + 2.0 ** -52, "float64") == 1.0 + 2.0 ** -52
    rng = np.random.default_rng(801)
    x = rng.standard_normal(1000)
    for dt in ("float16", "bfloat16", "float32"):
        r = ref.round_to(x, dt)
        np.testing.assert_array_equal(ref.round_to(r, dt), r)  # idempotent
        assert np.max(np.abs(r - x) / np.abs(x)) <= ref.unit_roundoff(dt)
