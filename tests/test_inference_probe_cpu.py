"""Adversarial probes of the inference entry points on the CPU (NumPy) path: `attention_varlen`,
`attention_varlen_backward` and `attention_with_kvcache` (contiguous and paged caches, with and
without appends), their lse and `merge_states` over their results.

Every expected value here is built independently of the entry points and of the package's
composite references (`reference.attention_varlen_ref`, `attention_with_kvcache_ref`,
`gather_kv_cache`): `reference.attention_ref` / `attention_backward_ref` on each sequence, sliced
from the packed arrays by the offsets or gathered key by key through the block table with an
explicit loop, grouped heads written out with np.repeat (dk, dv summed over the group by hand).
Outputs are judged by the project's pass rules (`reference.pass_threshold`,
`grad_pass_threshold`); rows that see no key must be exactly 0 with lse -inf and gradients 0.
"""
import math

import numpy as np
import pytest

import cuflash
from cuflash import reference

from seeds import SEED, case_rng

DTYPES = ["float16", "bfloat16", "float32", "float64"]
U32 = 2.0 ** -24


def _rng(*key):
    return case_rng(SEED, "inference_probe_cpu", *key)


def _as(x, dtype):
    if dtype == "bfloat16":
        import ml_dtypes

        return np.asarray(x).astype(ml_dtypes.bfloat16)
    return np.asarray(x).astype(dtype)


def _randn(rng, shape, dtype):
    """float64 values exactly representable in `dtype` (never all zeros)."""
    return reference.round_to(rng.standard_normal(shape), dtype)


def _t(x):
    return np.asarray(x, dtype=np.float64).transpose(1, 0, 2)


def _rep(x, h):
    """(S, Hkv, C) -> (S, H, C): each kv head repeated H / Hkv times (the GQA rule written out)."""
    return np.repeat(x, h // x.shape[1], axis=1)


def _check_lse(lse, lse_ref, what):
    """lse against float64: -inf exactly where the reference has no key, else within the
    tolerance the project's inference tests use (float32 lse: 1e-4 + 1e-5 |lse|)."""
    lse = np.asarray(lse, dtype=np.float64)
    fin = np.isfinite(lse_ref)
    assert not np.isnan(lse).any(), f"{what}: lse has NaN"
    assert np.array_equal(np.isneginf(lse), ~fin), f"{what}: lse = -inf exactly where no key"
    err = np.abs(lse[fin] - lse_ref[fin])
    assert np.all(err <= 1e-4 + 1e-5 * np.abs(lse_ref[fin])), f"{what}: lse error {err.max():.3e}"


def _judge(o, q, k, v, *, causal, scale, dtype, what):
    """o (H, Sq, Dv) of one sequence with q (H, Sq, D), k, v (H, Sk, .) float64 (heads already
    repeated) under the pass rule; rows that see no key exactly 0. Returns the reference lse."""
    o_ref, lse_ref = reference.attention_ref(q, k, v, causal=causal, scale=scale)
    rule = reference.pass_threshold(q, k, v, causal=causal, scale=scale, dtype=dtype, o_ref=o_ref)
    verdict = rule.judge(o)
    assert verdict.passed, f"{what}: " + "; ".join(verdict.reasons)
    empty = np.isneginf(lse_ref)
    assert np.all(np.asarray(o, dtype=np.float64)[empty] == 0), f"{what}: no-key rows not 0"
    return lse_ref


# ---------------------------------------------------------------------------------------------
# attention_varlen

# (lens_q, lens_k): 0 and 1 among long ones, Sq > Sk and Sq < Sk per sequence, a sequence with
# queries and no keys, one with keys and no queries, cu_seqlens_q != cu_seqlens_k.
VARLEN_LENS = [
    ([0, 1, 37, 1, 0, 50, 9], [3, 1, 60, 0, 5, 20, 9]),
    ([41], [7]),
    ([1, 1, 1], [70, 0, 2]),
]
HEADS = [(4, 4), (6, 2), (4, 1)]


def _packed(rng, lens_q, lens_k, h, hkv, d, dv, dtype, pad_q=0):
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    q = _randn(rng, (int(cu_q[-1]) + pad_q, h, d), dtype)
    k = _randn(rng, (max(int(cu_k[-1]), 1), hkv, d), dtype)
    v = _randn(rng, (max(int(cu_k[-1]), 1), hkv, dv), dtype)
    return q, k, v, cu_q, cu_k


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads", HEADS, ids=lambda x: f"H{x[0]}kv{x[1]}")
@pytest.mark.parametrize("lens", range(len(VARLEN_LENS)))
def test_varlen_forward_per_sequence(lens, heads, causal, dtype):
    """Each sequence of attention_varlen against attention_ref on its slices (D != Dv, a scale
    that is not the default, max_seqlen larger than every sequence, two trailing query rows of no
    sequence: 0 and -inf)."""
    rng = _rng("varlen", lens, heads, causal, dtype)
    lens_q, lens_k = VARLEN_LENS[lens]
    h, hkv = heads
    d, dv, scale = 16, 8, 0.37
    q, k, v, cu_q, cu_k = _packed(rng, lens_q, lens_k, h, hkv, d, dv, dtype, pad_q=2)
    o = np.full((q.shape[0], h, dv), np.nan, dtype=_as(np.zeros(1), dtype).dtype)
    lse = np.full((h, q.shape[0]), np.nan, np.float32)
    mq, mk = max(lens_q) + 13, max(lens_k) + 5
    res = cuflash.attention_varlen(_as(q, dtype), _as(k, dtype), _as(v, dtype), cu_q, cu_k, mq, mk,
                                   causal=causal, scale=scale, return_lse=True, out=(o, lse))
    assert res[0] is o and res[1] is lse
    for s in range(len(lens_q)):
        q0, q1, k0, k1 = int(cu_q[s]), int(cu_q[s + 1]), int(cu_k[s]), int(cu_k[s + 1])
        if q1 == q0:
            continue
        what = f"sequence {s} ({q1 - q0} x {k1 - k0})"
        if k1 == k0:
            assert np.all(o[q0:q1].astype(np.float64) == 0), what
            assert np.all(np.isneginf(lse[:, q0:q1])), what
            continue
        lse_ref = _judge(_t(o[q0:q1]), _t(q[q0:q1]), _t(_rep(k[k0:k1], h)), _t(_rep(v[k0:k1], h)),
                         causal=causal, scale=scale, dtype=dtype, what=what)
        _check_lse(lse[:, q0:q1], lse_ref, what)
        if causal and q1 - q0 > k1 - k0:   # rows that see no key: exactly 0 and -inf
            n = (q1 - q0) - (k1 - k0)
            assert np.all(o[q0:q0 + n].astype(np.float64) == 0) and np.all(
                np.isneginf(lse[:, q0:q0 + n])), what
    tail = slice(int(cu_q[-1]), None)
    assert np.all(o[tail].astype(np.float64) == 0) and np.all(np.isneginf(lse[:, tail]))


# ---------------------------------------------------------------------------------------------
# attention_varlen_backward

def _varlen_grads_ref(do, q, k, v, cu_q, cu_k, *, causal, scale, h, hkv):
    """float64 gradients per sequence with the kv heads repeated to H and dk, dv summed over
    each group by hand."""
    dq, dk, dv = np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)
    g = h // hkv
    for s in range(cu_q.size - 1):
        q0, q1, k0, k1 = int(cu_q[s]), int(cu_q[s + 1]), int(cu_k[s]), int(cu_k[s + 1])
        if q1 == q0 or k1 == k0:
            continue
        gq, gk, gv = reference.attention_backward_ref(
            _t(do[q0:q1]), _t(q[q0:q1]), _t(_rep(k[k0:k1], h)), _t(_rep(v[k0:k1], h)),
            causal=causal, scale=scale)
        dq[q0:q1] = gq.transpose(1, 0, 2)
        dk[k0:k1] = gk.reshape(hkv, g, k1 - k0, -1).sum(axis=1).transpose(1, 0, 2)
        dv[k0:k1] = gv.reshape(hkv, g, k1 - k0, -1).sum(axis=1).transpose(1, 0, 2)
    return dq, dk, dv


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads", HEADS, ids=lambda x: f"H{x[0]}kv{x[1]}")
def test_varlen_backward_per_sequence(heads, causal, dtype):
    """dq, dk, dv per sequence under the gradient rule (dk, dv of a kv head summed over its
    query heads), D != Dv, exact zeros for rows that see no key and sequences without keys or
    queries, rows of no sequence 0; deterministic=True twice gives the same bits."""
    rng = _rng("varlen_bwd", heads, causal, dtype)
    lens_q, lens_k = [0, 1, 23, 1, 11, 6], [4, 1, 9, 0, 30, 6]
    h, hkv = heads
    d, dv, scale = 8, 12, 0.41
    q, k, v, cu_q, cu_k = _packed(rng, lens_q, lens_k, h, hkv, d, dv, dtype, pad_q=1)
    qc, kc, vc = (_as(x, dtype) for x in (q, k, v))
    mq, mk = max(lens_q) + 3, max(lens_k) + 7
    o, lse = cuflash.attention_varlen(qc, kc, vc, cu_q, cu_k, mq, mk, causal=causal, scale=scale,
                                      return_lse=True)
    do = _randn(rng, o.shape, dtype)
    args = (_as(do, dtype), qc, kc, vc, o, lse, cu_q, cu_k, mq, mk)
    out = tuple(np.full(x.shape, np.nan, dtype=x.dtype) for x in (qc, kc, vc))
    grads = cuflash.attention_varlen_backward(*args, causal=causal, scale=scale,
                                              deterministic=True, out=out)
    assert all(g is b for g, b in zip(grads, out))
    again = cuflash.attention_varlen_backward(*args, causal=causal, scale=scale,
                                              deterministic=True)
    for a, b in zip(grads, again):
        assert a.tobytes() == b.tobytes(), "deterministic=True: different bits on a second run"
    ref = _varlen_grads_ref(do, q, k, v, cu_q, cu_k, causal=causal, scale=scale, h=h, hkv=hkv)
    got = [np.asarray(x, dtype=np.float64) for x in grads]
    for s in range(len(lens_q)):
        q0, q1, k0, k1 = int(cu_q[s]), int(cu_q[s + 1]), int(cu_k[s]), int(cu_k[s + 1])
        what = f"sequence {s} ({q1 - q0} x {k1 - k0})"
        if q1 == q0 or k1 == k0:
            assert np.all(got[0][q0:q1] == 0) and np.all(got[1][k0:k1] == 0) and np.all(
                got[2][k0:k1] == 0), what
            continue
        seg = [_t(x) for x in (do[q0:q1], q[q0:q1], k[k0:k1], v[k0:k1])]
        tols, naive = reference.grad_pass_threshold(*seg, causal=causal, scale=scale, dtype=dtype)
        for name, gi, lo, hi, tol, ne in zip(("dq", "dk", "dv"), range(3), (q0, k0, k0),
                                             (q1, k1, k1), tols, naive):
            err = float(np.max(np.abs(got[gi][lo:hi] - ref[gi][lo:hi])))
            assert err <= tol, (f"{what} {name}: max abs error {err:.3e} > threshold {tol:.3e} "
                                f"(naive {dtype} {ne:.3e})")
        if causal and q1 - q0 > k1 - k0:
            assert np.all(got[0][q0:q0 + (q1 - q0) - (k1 - k0)] == 0), f"{what}: no-key dq"
    assert np.all(got[0][int(cu_q[-1]):] == 0)


def test_varlen_backward_group_sum_matches_repeated_heads_float64():
    """float64: the grouped backward equals the repeated-head backward summed by hand to
    rounding (a group-sum that dropped or double-counted a head would be off by O(1))."""
    rng = _rng("varlen_bwd_group")
    h, hkv = 8, 2
    lens_q, lens_k = [5, 0, 12], [7, 3, 4]
    q, k, v, cu_q, cu_k = _packed(rng, lens_q, lens_k, h, hkv, 8, 8, "float64")
    o, lse = cuflash.attention_varlen(q, k, v, cu_q, cu_k, 12, 7, causal=True, return_lse=True)
    do = rng.standard_normal(o.shape)
    grads = cuflash.attention_varlen_backward(do, q, k, v, o, lse, cu_q, cu_k, 12, 7, causal=True)
    ref = _varlen_grads_ref(do, q, k, v, cu_q, cu_k, causal=True, scale=None, h=h, hkv=hkv)
    for g, r in zip(grads, ref):
        np.testing.assert_allclose(g, r, rtol=1e-10, atol=1e-12)


# ---------------------------------------------------------------------------------------------
# attention_with_kvcache

def _gather_loop(cache, length, b, bt):
    """The first `length` keys of sequence b, one key at a time (no fancy indexing)."""
    rows = []
    for j in range(int(length)):
        if bt is None:
            rows.append(cache[b, j])
        else:
            p = cache.shape[1]
            rows.append(cache[int(bt[b, j // p]), j % p])
    return np.array(rows, dtype=np.float64).reshape((int(length),) + cache.shape[2:])


def _expected_after_append(cache, lens, new, bt):
    """The cache after writing new[b, t] at key lens[b] + t of sequence b, key by key."""
    out = cache.copy()
    for b in range(new.shape[0]):
        for t in range(new.shape[1]):
            j = int(lens[b]) + t
            if bt is None:
                out[b, j] = new[b, t]
            else:
                p = cache.shape[1]
                out[int(bt[b, j // p]), j % p] = new[b, t]
    return out


def _cache_problem(rng, *, b, hkv, h, sq, d, dv, lens, snew, page, dtype):
    cap = int(max(lens)) + snew
    if page is None:
        kshape, vshape, bt = (b, cap + 3, hkv, d), (b, cap + 3, hkv, dv), None
    else:
        per = max(1, -(-cap // page)) + 1           # one spare page a row, never touched
        n = b * per + 2
        kshape, vshape = (n, page, hkv, d), (n, page, hkv, dv)
        bt = rng.permutation(n)[:b * per].reshape(b, per).astype(np.int32)   # shuffled pages
    kc, vc = _randn(rng, kshape, dtype), _randn(rng, vshape, dtype)
    q = _randn(rng, (b, sq, h, d), dtype)
    kn = vn = None
    if snew:
        kn, vn = _randn(rng, (b, snew, hkv, d), dtype), _randn(rng, (b, snew, hkv, dv), dtype)
    return q, kc, vc, bt, kn, vn


KV_CASES = [
    # (page, lens, snew): an empty cache with and without appends, one key, appends that cross
    # a page boundary (14 + 5 over 16, 60 + 7 over 64, 30 + 3 over 32 with page 16), full pages
    (None, [0, 1, 14, 37], 0),
    (None, [0, 1, 14, 37], 5),
    (16, [0, 1, 14, 30], 0),
    (16, [0, 1, 14, 30], 5),
    (16, [0, 16, 31, 2], 1),
    (64, [0, 1, 60, 64], 7),
    (64, [0, 3, 63, 5], 0),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", range(len(KV_CASES)))
def test_kvcache_per_sequence(case, causal, dtype):
    """Each sequence against attention_ref on its first L_b = cache_seqlens[b] + Snew keys
    (gathered key by key through a shuffled block table, the appended ones taken from k_new, not
    from the cache), grouped heads, D != Dv, Sq = 4 > L_b for some sequences under causal (rows
    with no key: 0, -inf); the whole cache after the call equals the cache before with exactly
    the new keys written at their positions."""
    page, lens, snew = KV_CASES[case]
    rng = _rng("kv", case, causal, dtype)
    b, hkv, h, sq, d, dv, scale = 4, 2, 6, 4, 16, 8, 0.29
    lens = np.array(lens, np.int32)
    q, kc, vc, bt, kn, vn = _cache_problem(rng, b=b, hkv=hkv, h=h, sq=sq, d=d, dv=dv, lens=lens,
                                           snew=snew, page=page, dtype=dtype)
    k_cache, v_cache = _as(kc, dtype), _as(vc, dtype)
    o = np.full((b, sq, h, dv), np.nan, dtype=k_cache.dtype)
    lse = np.full((b, h, sq), np.nan, np.float32)
    res = cuflash.attention_with_kvcache(
        _as(q, dtype), k_cache, v_cache, lens, block_table=bt,
        k_new=None if kn is None else _as(kn, dtype), v_new=None if vn is None else _as(vn, dtype),
        causal=causal, scale=scale, return_lse=True, out=(o, lse))
    assert res[0] is o and res[1] is lse
    for i in range(b):
        what = f"sequence {i} (cache {lens[i]} + {snew} new)"
        k_i, v_i = _gather_loop(kc, lens[i], i, bt), _gather_loop(vc, lens[i], i, bt)
        if snew:
            k_i, v_i = np.concatenate([k_i, kn[i]]), np.concatenate([v_i, vn[i]])
        if k_i.shape[0] == 0:
            assert np.all(o[i].astype(np.float64) == 0) and np.all(np.isneginf(lse[i])), what
            continue
        o_i = o[i].astype(np.float64).transpose(1, 0, 2)
        lse_ref = _judge(o_i, _t(q[i]), _t(_rep(k_i, h)), _t(_rep(v_i, h)), causal=causal,
                         scale=scale, dtype=dtype, what=what)
        _check_lse(lse[i], lse_ref, what)
    # the caches: before + exactly the new keys (bit for bit), nothing else touched
    want_k = kc if not snew else _expected_after_append(kc, lens, kn, bt)
    want_v = vc if not snew else _expected_after_append(vc, lens, vn, bt)
    np.testing.assert_array_equal(k_cache.astype(np.float64), want_k)
    np.testing.assert_array_equal(v_cache.astype(np.float64), want_v)


@pytest.mark.parametrize("page", [None, 16])
def test_kvcache_int_seqlens_and_empty_with_append(page):
    """An int cache_seqlens (0: an empty cache, and 0 with an append that fills more than one
    page) gives what the same lengths as an array give, bit for bit, caches included."""
    rng = _rng("kv_int", page)
    for length, snew in ((0, 0), (0, 19), (5, 12)):
        lens = np.full(3, length, np.int32)
        q, kc, vc, bt, kn, vn = _cache_problem(rng, b=3, hkv=1, h=4, sq=2, d=8, dv=8, lens=lens,
                                               snew=snew, page=page, dtype="float32")
        kw = dict(block_table=bt, causal=True, return_lse=True)
        if snew:
            kw.update(k_new=kn.astype(np.float32), v_new=vn.astype(np.float32))
        caches = [(kc.astype(np.float32), vc.astype(np.float32)) for _ in range(2)]
        a = cuflash.attention_with_kvcache(q.astype(np.float32), *caches[0], length, **kw)
        b_ = cuflash.attention_with_kvcache(q.astype(np.float32), *caches[1], lens, **kw)
        for x, y in zip(a + caches[0], b_ + caches[1]):
            assert x.tobytes() == y.tobytes()
        if length + snew == 0:
            assert np.all(a[0] == 0) and np.all(np.isneginf(a[1]))


def test_kvcache_repeated_decode_steps_match_one_call():
    """Three decode steps appending one key each (advancing cache_seqlens by hand, Sq = 1,
    causal, paged 16 across a page boundary) leave the cache and the last output as one call
    with the three keys appended at once and the last query."""
    rng = _rng("kv_steps")
    lens = np.array([14, 0, 15], np.int32)
    q, kc, vc, bt, kn, vn = _cache_problem(rng, b=3, hkv=2, h=4, sq=1, d=8, dv=8, lens=lens,
                                           snew=3, page=16, dtype="float64")
    k1, v1 = kc.copy(), vc.copy()
    cur = lens.copy()
    for t in range(3):
        o1, l1 = cuflash.attention_with_kvcache(q, k1, v1, cur, block_table=bt,
                                                k_new=kn[:, t:t + 1], v_new=vn[:, t:t + 1],
                                                causal=True, return_lse=True)
        cur = cur + 1
    k2, v2 = kc.copy(), vc.copy()
    o2, l2 = cuflash.attention_with_kvcache(q, k2, v2, lens, block_table=bt, k_new=kn, v_new=vn,
                                            causal=True, return_lse=True)
    np.testing.assert_array_equal(k1, k2)
    np.testing.assert_array_equal(v1, v2)
    np.testing.assert_allclose(o1, o2, rtol=0, atol=1e-14)
    np.testing.assert_allclose(l1, l2, rtol=0, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# merge_states over the inference entry points' results

def _merge_extra(dtype, o_ref, parts):
    """The documented extra error of a merge (as tests/test_cpu.py's merge test): each part
    rounded to the dtype before the merge, and the float32 lse in the weights."""
    o_max = max(float(np.max(np.abs(np.asarray(o, dtype=np.float64)))) for o, _ in parts)
    fin = [np.asarray(l, dtype=np.float64)[np.isfinite(l)] for _, l in parts]
    lse_max = max([float(np.max(np.abs(f))) for f in fin if f.size] or [0.0])
    return 2 * reference.unit_roundoff(dtype) * float(np.max(np.abs(o_ref))) + \
        4 * U32 * (1 + lse_max) * o_max


@pytest.mark.parametrize("dtype", DTYPES)
def test_merge_varlen_key_halves(dtype):
    """attention_varlen over the first and the rest of each sequence's keys (one part empty for
    some sequences), merged by merge_states in the (H, total_q, Dv) layout, against attention_ref
    on all of the sequence's keys."""
    rng = _rng("merge_varlen", dtype)
    h, hkv, d = 4, 2, 16
    lens_q, lens_k = [3, 1, 9, 4], [10, 1, 40, 2]
    cut = [4, 0, 25, 2]         # keys of part a; part b is empty for the last
    q, k, v, cu_q, cu_k = _packed(rng, lens_q, lens_k, h, hkv, d, d, dtype)
    ka, va, kb, vb = [], [], [], []
    for s, c in enumerate(cut):
        k0, k1 = int(cu_k[s]), int(cu_k[s + 1])
        ka.append(k[k0:k0 + c]); va.append(v[k0:k0 + c])
        kb.append(k[k0 + c:k1]); vb.append(v[k0 + c:k1])
    cu_a = np.concatenate([[0], np.cumsum(cut)]).astype(np.int32)
    cu_b = np.concatenate([[0], np.cumsum(np.array(lens_k) - cut)]).astype(np.int32)
    parts = []
    for kk, vv, cu in ((ka, va, cu_a), (kb, vb, cu_b)):
        o, lse = cuflash.attention_varlen(_as(q, dtype), _as(np.concatenate(kk), dtype),
                                          _as(np.concatenate(vv), dtype), cu_q, cu, 9, 40,
                                          return_lse=True)
        parts.append((o.transpose(1, 0, 2), lse))
    o, lse = cuflash.merge_states(parts[0][0], parts[0][1], parts[1][0], parts[1][1])
    for s in range(len(lens_q)):
        q0, q1, k0, k1 = int(cu_q[s]), int(cu_q[s + 1]), int(cu_k[s]), int(cu_k[s + 1])
        qs, ks, vs = _t(q[q0:q1]), _t(_rep(k[k0:k1], h)), _t(_rep(v[k0:k1], h))
        o_ref, lse_ref = reference.attention_ref(qs, ks, vs)
        extra = _merge_extra(dtype, o_ref, [(p[0][:, q0:q1], p[1][:, q0:q1]) for p in parts])
        rule = reference.pass_threshold(qs, ks, vs, dtype=dtype, o_ref=o_ref).widened(extra)
        verdict = rule.judge(o[:, q0:q1])
        assert verdict.passed, f"sequence {s}: " + "; ".join(verdict.reasons)
        _check_lse(lse[:, q0:q1], lse_ref, f"sequence {s}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page", [None, 16, 64])
def test_merge_kvcache_shards(page, dtype):
    """A cache split into two shards (the first c_b keys of each sequence in one cache, the rest
    in another, one shard empty for some sequences), each attended by attention_with_kvcache and
    merged in the (B, H, Sq, Dv) layout, against attention_ref on all the keys."""
    rng = _rng("merge_kv", page, dtype)
    b, hkv, h, sq, d = 3, 1, 4, 2, 16
    full = np.array([20, 5, 70], np.int32)
    cut = np.array([7, 0, 70], np.int32)
    q = _randn(rng, (b, sq, h, d), dtype)
    k_all = [_randn(rng, (int(n), hkv, d), dtype) for n in full]
    v_all = [_randn(rng, (int(n), hkv, d), dtype) for n in full]
    parts = []
    for lo, hi in ((np.zeros_like(cut), cut), (cut, full)):
        lens = hi - lo
        _, kc, vc, bt, _, _ = _cache_problem(rng, b=b, hkv=hkv, h=h, sq=sq, d=d, dv=d,
                                             lens=np.maximum(lens, 1), snew=0, page=page,
                                             dtype=dtype)
        for i in range(b):   # write shard i's keys into its cache, key by key
            for j in range(int(lens[i])):
                src = int(lo[i]) + j
                if bt is None:
                    kc[i, j], vc[i, j] = k_all[i][src], v_all[i][src]
                else:
                    pg = kc.shape[1]
                    kc[bt[i, j // pg], j % pg] = k_all[i][src]
                    vc[bt[i, j // pg], j % pg] = v_all[i][src]
        o, lse = cuflash.attention_with_kvcache(_as(q, dtype), _as(kc, dtype), _as(vc, dtype),
                                                lens.astype(np.int32), block_table=bt,
                                                return_lse=True)
        parts.append((o.transpose(0, 2, 1, 3), lse))
    o, lse = cuflash.merge_states(parts[0][0], parts[0][1], parts[1][0], parts[1][1])
    for i in range(b):
        qs, ks, vs = _t(q[i]), _t(_rep(k_all[i], h)), _t(_rep(v_all[i], h))
        o_ref, lse_ref = reference.attention_ref(qs, ks, vs)
        extra = _merge_extra(dtype, o_ref, [(p[0][i], p[1][i]) for p in parts])
        rule = reference.pass_threshold(qs, ks, vs, dtype=dtype, o_ref=o_ref).widened(extra)
        verdict = rule.judge(o[i])
        assert verdict.passed, f"sequence {i}: " + "; ".join(verdict.reasons)
        _check_lse(lse[i], lse_ref, f"sequence {i}")


# ---------------------------------------------------------------------------------------------
# What lies outside the sequences must not matter; NaN reaches exactly the rows that see it

@pytest.mark.parametrize("page", [None, 16])
def test_kvcache_garbage_outside_the_sequences_is_never_read(page):
    """NaN and inf in every cache row past L_b (and in the pages no sequence names), and -1 or
    out-of-range page numbers in the block-table entries past a sequence's last page, give the
    clean run's results bit for bit (and the append writes only the new keys)."""
    rng = _rng("kv_garbage", page)
    lens = np.array([0, 17, 3], np.int32)
    q, kc, vc, bt, kn, vn = _cache_problem(rng, b=3, hkv=2, h=4, sq=3, d=8, dv=8, lens=lens,
                                           snew=2, page=page, dtype="float32")
    q, kn, vn = (x.astype(np.float32) for x in (q, kn, vn))
    clean = [x.astype(np.float32) for x in (kc, vc)]
    dirty = [x.astype(np.float32) for x in (kc, vc)]
    used = np.zeros(dirty[0].shape[:2], bool)          # the key slots some sequence reads
    for i in range(3):
        for j in range(int(lens[i]) + 2):
            used[(i, j) if bt is None else (bt[i, j // page], j % page)] = True
    for x in dirty:
        x[~used] = np.nan
        x[~used & (rng.random(used.shape) < 0.5)] = np.inf
    bt_dirty = None
    if bt is not None:
        bt_dirty = bt.copy()
        for i in range(3):
            need = -(-(int(lens[i]) + 2) // page)
            bt_dirty[i, need:] = [-1, 10**6][i % 2]
    a = cuflash.attention_with_kvcache(q, *clean, lens, block_table=bt, k_new=kn, v_new=vn,
                                       causal=True, return_lse=True)
    b_ = cuflash.attention_with_kvcache(q, *dirty, lens, block_table=bt_dirty, k_new=kn,
                                        v_new=vn, causal=True, return_lse=True)
    for x, y in zip(a, b_):
        assert x.tobytes() == y.tobytes()
    for x, y in zip(clean, dirty):
        np.testing.assert_array_equal(x[used], y[used])


def test_kvcache_shared_prefix_pages():
    """Two sequences reading the same prefix pages (prefix caching) and appending into pages of
    their own: each against attention_ref on its own keys."""
    rng = _rng("kv_prefix")
    page, hkv, h, d = 16, 2, 4, 8
    kc = _randn(rng, (6, page, hkv, d), "float64")
    vc = _randn(rng, (6, page, hkv, d), "float64")
    bt = np.array([[4, 1, 0], [4, 1, 5]], np.int32)     # pages 4 and 1 shared: 32 prefix keys
    lens = np.array([32, 35], np.int32)
    kn, vn = (_randn(rng, (2, 3, hkv, d), "float64") for _ in range(2))
    q = _randn(rng, (2, 2, h, d), "float64")
    before = (kc.copy(), vc.copy())
    o, lse = cuflash.attention_with_kvcache(q, kc, vc, lens, block_table=bt, k_new=kn, v_new=vn,
                                            causal=True, return_lse=True)
    for i in range(2):
        k_i = np.concatenate([_gather_loop(before[0], lens[i], i, bt), kn[i]])
        v_i = np.concatenate([_gather_loop(before[1], lens[i], i, bt), vn[i]])
        lse_ref = _judge(o[i].transpose(1, 0, 2), _t(q[i]), _t(_rep(k_i, h)), _t(_rep(v_i, h)),
                         causal=True, scale=None, dtype="float64", what=f"sequence {i}")
        _check_lse(lse[i], lse_ref, f"sequence {i}")


def test_nan_reaches_exactly_the_rows_that_see_it():
    """A NaN in the value of a sequence's last key: under causal (Sq > 1) only the last query row
    of that sequence sees it, so only that row is NaN, in attention_varlen and in
    attention_with_kvcache (also when the key was just appended); the other sequences are clean.
    """
    rng = _rng("nan_rows")
    h, d = 2, 8
    lens_q, lens_k = [3, 4], [5, 6]
    q, k, v, cu_q, cu_k = _packed(rng, lens_q, lens_k, h, h, d, d, "float32")
    q, k, v = (x.astype(np.float32) for x in (q, k, v))
    v[int(cu_k[1]) - 1, 0, 2] = np.nan             # last key of sequence 0, head 0, column 2
    o, lse = cuflash.attention_varlen(q, k, v, cu_q, cu_k, 4, 6, causal=True, return_lse=True)
    bad = np.zeros(o.shape, bool)
    bad[int(cu_q[1]) - 1, 0, 2] = True
    assert np.array_equal(np.isnan(o), bad) and np.isfinite(lse).all()
    for snew in (0, 1):
        kc = _randn(rng, (2, 8, h, d), "float32").astype(np.float32)
        vc = _randn(rng, (2, 8, h, d), "float32").astype(np.float32)
        lens = np.array([5 - snew, 3 - snew], np.int32)
        kn = vn = None
        if snew:
            kn, vn = (_randn(rng, (2, 1, h, d), "float32").astype(np.float32) for _ in range(2))
            vn[0, 0, 1, 3] = np.nan
        else:
            vc[0, 4, 1, 3] = np.nan
        qq = _randn(rng, (2, 3, h, d), "float32").astype(np.float32)
        o, lse = cuflash.attention_with_kvcache(qq, kc, vc, lens, k_new=kn, v_new=vn, causal=True,
                                                return_lse=True)
        bad = np.zeros(o.shape, bool)
        bad[0, 2, 1, 3] = True
        assert np.array_equal(np.isnan(o), bad), snew
        assert np.isfinite(lse).all()


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_kvcache_long_sequence_tiles(dtype):
    """Sequences longer than the CPU path's 512-key tile (and past 8 tiles: Kahan sums) with
    causal Sq = 5 decoding, paged 64, against attention_ref."""
    rng = _rng("kv_long", dtype)
    lens = np.array([511, 513, 4100], np.int32)
    q, kc, vc, bt, kn, vn = _cache_problem(rng, b=3, hkv=1, h=2, sq=5, d=8, dv=8, lens=lens,
                                           snew=3, page=64, dtype=dtype)
    o, lse = cuflash.attention_with_kvcache(_as(q, dtype), _as(kc, dtype), _as(vc, dtype), lens,
                                            block_table=bt, k_new=_as(kn, dtype),
                                            v_new=_as(vn, dtype), causal=True, return_lse=True)
    for i in range(3):
        k_i = np.concatenate([_gather_loop(kc, lens[i], i, bt), kn[i]])
        v_i = np.concatenate([_gather_loop(vc, lens[i], i, bt), vn[i]])
        lse_ref = _judge(o[i].astype(np.float64).transpose(1, 0, 2), _t(q[i]), _t(_rep(k_i, 2)),
                         _t(_rep(v_i, 2)), causal=True, scale=None, dtype=dtype,
                         what=f"sequence {i}")
        _check_lse(lse[i], lse_ref, f"sequence {i}")


# ---------------------------------------------------------------------------------------------
# out= buffers that alias an input (README, "Errors": not checked; the CPU path reads its inputs
# before it writes, so the result is the fresh buffer's)

def test_varlen_out_aliasing_an_input_gives_the_fresh_result():
    """attention_varlen with out=q (or v, or k) and attention_varlen_backward with out=(q, k, v)
    (or (do, k, v)) give the results of fresh buffers, bit for bit: the CPU path once zeroed
    out before reading the inputs (errors of order 1)."""
    rng = _rng("alias")
    lens_q, lens_k = [3, 0, 5, 2], [4, 2, 5, 0]
    q, k, v, cu_q, cu_k = _packed(rng, lens_q, lens_k, 4, 2, 8, 8, "float64", pad_q=1)
    kh, vh = _rep(k, 4), _rep(v, 4)       # kv with H heads: q, k, v and o of one shape
    assert q.shape == kh.shape == vh.shape
    want, want_lse = cuflash.attention_varlen(q, kh, vh, cu_q, cu_k, 5, 5, causal=True,
                                              return_lse=True)
    for which in range(3):
        args = [q.copy(), kh.copy(), vh.copy()]
        buf = args[which]
        got = cuflash.attention_varlen(*args, cu_q, cu_k, 5, 5, causal=True, out=buf)
        assert got is buf and got.tobytes() == want.tobytes(), f"out= aliasing input {which}"
    do = _randn(rng, want.shape, "float64")
    grads = cuflash.attention_varlen_backward(do, q, kh, vh, want, want_lse, cu_q, cu_k, 5, 5,
                                              causal=True)
    for names in (("q", "k", "v"), ("do", "k", "v")):
        ins = dict(do=do.copy(), q=q.copy(), k=kh.copy(), v=vh.copy(), o=want.copy())
        out = tuple(ins[n] for n in names)
        got = cuflash.attention_varlen_backward(ins["do"], ins["q"], ins["k"], ins["v"], ins["o"],
                                                want_lse, cu_q, cu_k, 5, 5, causal=True, out=out)
        for g, w, b in zip(got, grads, out):
            assert g is b and g.tobytes() == w.tobytes(), f"out={names}"


def test_kvcache_out_aliasing_q_gives_the_fresh_result():
    """attention_with_kvcache with out=q (D == Dv): the fresh buffer's result, bit for bit."""
    rng = _rng("alias_kv")
    lens = np.array([5, 0, 9], np.int32)
    q, kc, vc, bt, kn, vn = _cache_problem(rng, b=3, hkv=2, h=4, sq=3, d=8, dv=8, lens=lens,
                                           snew=2, page=16, dtype="float64")
    caches = [(kc.copy(), vc.copy()) for _ in range(2)]
    want = cuflash.attention_with_kvcache(q, *caches[0], lens, block_table=bt, k_new=kn,
                                          v_new=vn, causal=True)
    qq = q.copy()
    got = cuflash.attention_with_kvcache(qq, *caches[1], lens, block_table=bt, k_new=kn,
                                         v_new=vn, causal=True, out=qq)
    assert got is qq and got.tobytes() == want.tobytes()


def test_varlen_backward_ignores_rows_and_keys_of_no_sequence():
    """NaN in the rows past cu_seqlens_q[-1] of q, o, do and lse (what the GPU forward leaves
    unwritten) and in the keys past cu_seqlens_k[-1]: the clean gradients bit for bit, those rows
    and keys 0."""
    rng = _rng("bwd_tails")
    lens_q, lens_k = [4, 0, 6], [5, 3, 2]
    q, k, v, cu_q, cu_k = _packed(rng, lens_q, lens_k, 4, 2, 8, 8, "float32", pad_q=3)
    k = np.concatenate([k, _randn(rng, (2,) + k.shape[1:], "float32")])
    v = np.concatenate([v, _randn(rng, (2,) + v.shape[1:], "float32")])
    q, k, v = (x.astype(np.float32) for x in (q, k, v))
    o, lse = cuflash.attention_varlen(q, k, v, cu_q, cu_k, 6, 5, causal=True, return_lse=True)
    do = _randn(rng, o.shape, "float32").astype(np.float32)
    want = cuflash.attention_varlen_backward(do, q, k, v, o, lse, cu_q, cu_k, 6, 5, causal=True)
    nq, nk = int(cu_q[-1]), int(cu_k[-1])
    q2, k2, v2, o2, do2, lse2 = (x.copy() for x in (q, k, v, o, do, lse))
    for x in (q2, o2, do2):
        x[nq:] = np.nan
    lse2[:, nq:] = np.nan
    k2[nk:], v2[nk:] = np.nan, np.inf
    got = cuflash.attention_varlen_backward(do2, q2, k2, v2, o2, lse2, cu_q, cu_k, 6, 5,
                                            causal=True)
    for g, w in zip(got, want):
        assert g.tobytes() == w.tobytes()
    assert np.all(got[0][nq:] == 0) and np.all(got[1][nk:] == 0) and np.all(got[2][nk:] == 0)


@pytest.mark.parametrize("page", [None, 16])
def test_kvcache_filled_to_capacity(page):
    """cache_seqlens + Snew equal to the capacity (the last slot of the last page written by the
    append): against attention_ref, the cache as before plus the new keys."""
    rng = _rng("kv_full", page)
    b, hkv, h, d = 2, 1, 2, 8
    if page is None:
        cap = 20
        kc, vc = (_randn(rng, (b, cap, hkv, d), "float64") for _ in range(2))
        bt = None
    else:
        cap = 2 * page
        kc, vc = (_randn(rng, (5, page, hkv, d), "float64") for _ in range(2))
        bt = np.array([[3, 0], [4, 1]], np.int32)
    snew = 3
    lens = np.array([cap - snew, cap - snew - 5], np.int32)    # the first fills its capacity
    kn, vn = (_randn(rng, (b, snew, hkv, d), "float64") for _ in range(2))
    q = _randn(rng, (b, 2, h, d), "float64")
    before = (kc.copy(), vc.copy())
    o, lse = cuflash.attention_with_kvcache(q, kc, vc, lens, block_table=bt, k_new=kn, v_new=vn,
                                            causal=True, return_lse=True)
    np.testing.assert_array_equal(kc, _expected_after_append(before[0], lens, kn, bt))
    np.testing.assert_array_equal(vc, _expected_after_append(before[1], lens, vn, bt))
    for i in range(b):
        k_i = np.concatenate([_gather_loop(before[0], lens[i], i, bt), kn[i]])
        v_i = np.concatenate([_gather_loop(before[1], lens[i], i, bt), vn[i]])
        lse_ref = _judge(o[i].transpose(1, 0, 2), _t(q[i]), _t(_rep(k_i, h)), _t(_rep(v_i, h)),
                         causal=True, scale=None, dtype="float64", what=f"sequence {i}")
        _check_lse(lse[i], lse_ref, f"sequence {i}")


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("scale", [0.0, -0.5])
def test_varlen_scale_zero_and_negative(scale, dtype):
    """scale = 0 (uniform weights over the visible keys) and a negative scale, forward and
    backward, causal with Sq > Sk in one sequence."""
    rng = _rng("scale", scale, dtype)
    lens_q, lens_k = [1, 13, 9], [3, 6, 20]
    q, k, v, cu_q, cu_k = _packed(rng, lens_q, lens_k, 4, 2, 8, 8, dtype)
    qc, kc, vc = (_as(x, dtype) for x in (q, k, v))
    o, lse = cuflash.attention_varlen(qc, kc, vc, cu_q, cu_k, 13, 20, causal=True, scale=scale,
                                      return_lse=True)
    do = _randn(rng, o.shape, dtype)
    grads = cuflash.attention_varlen_backward(_as(do, dtype), qc, kc, vc, o, lse, cu_q, cu_k, 13,
                                              20, causal=True, scale=scale)
    ref = _varlen_grads_ref(do, q, k, v, cu_q, cu_k, causal=True, scale=scale, h=4, hkv=2)
    for s in range(len(lens_q)):
        q0, q1, k0, k1 = int(cu_q[s]), int(cu_q[s + 1]), int(cu_k[s]), int(cu_k[s + 1])
        lse_ref = _judge(_t(o[q0:q1]), _t(q[q0:q1]), _t(_rep(k[k0:k1], 4)), _t(_rep(v[k0:k1], 4)),
                         causal=True, scale=scale, dtype=dtype, what=f"sequence {s}")
        _check_lse(lse[:, q0:q1], lse_ref, f"sequence {s}")
        seg = [_t(x) for x in (do[q0:q1], q[q0:q1], k[k0:k1], v[k0:k1])]
        tols, _ = reference.grad_pass_threshold(*seg, causal=True, scale=scale, dtype=dtype)
        for gi, lo, hi in ((0, q0, q1), (1, k0, k1), (2, k0, k1)):
            err = float(np.max(np.abs(np.asarray(grads[gi], np.float64)[lo:hi] - ref[gi][lo:hi])))
            assert err <= tols[gi], f"sequence {s} grad {gi}: {err:.3e} > {tols[gi]:.3e}"
