"""The public API's checks of the buffers it writes (CPU, no GPU needed): ``out=`` buffers of every
entry point, and the KV cache `attention_with_kvcache` appends into.

Each test here guards a defect the adversarial review of the argument checks found (notes in the
commit messages): a buffer whose elements overlap (a stride-0 view made writeable, or two
output buffers sharing memory) was accepted and gave a silently wrong result; an ``out`` triple of
the backward holding None crashed inside the CPU path; appending into a read-only cache failed
half-way (k_cache written, then NumPy's error on v_cache). The GPU path's host-side checks are
exercised with the stand-in CuPy of tests/test_callcache.py.
"""
import numpy as np
import pytest

import cuflash
from cuflash import _callcache, reference
from seeds import SEED, case_rng
from test_callcache import FakeArray, fake  # noqa: F401  (the stand-in CuPy fixtures)
from test_kvcache_callcache import kvfake  # noqa: F401

as_strided = np.lib.stride_tricks.as_strided


def _arr(rng, *shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)


def _broadcast_writeable(shape, dtype=np.float32):
    """A writeable view of `shape` whose axis 0 has stride 0 (all its entries one memory)."""
    base = np.zeros((1,) + tuple(shape[1:]), dtype)
    return as_strided(base, shape, (0,) + base.strides[1:])


def _dense(key):
    rng = case_rng(SEED, "api_buffers", key)
    return _arr(rng, 2, 3, 10, 16), _arr(rng, 2, 3, 12, 16), _arr(rng, 2, 3, 12, 8)


def _varlen(key):
    rng = case_rng(SEED, "api_buffers_varlen", key)
    cq, ck = np.array([0, 3, 7, 10], np.int32), np.array([0, 5, 6, 12], np.int32)
    return (_arr(rng, 10, 4, 16), _arr(rng, 12, 2, 16), _arr(rng, 12, 2, 8)), (cq, ck, 4, 6)


def _kvcache(key):
    rng = case_rng(SEED, "api_buffers_kvcache", key)
    q, kc, vc = _arr(rng, 3, 2, 4, 16), _arr(rng, 3, 20, 2, 16), _arr(rng, 3, 20, 2, 8)
    return q, kc, vc, np.array([5, 1, 17], np.int32)


# -- out= buffers whose own elements overlap (stride 0 on an axis of size > 1) ---------------


def test_attention_out_broadcast_view_is_refused():
    q, k, v = _dense("bcast")
    with pytest.raises(ValueError, match="out has stride 0"):
        cuflash.attention(q, k, v, out=_broadcast_writeable((2, 3, 10, 8)))


def test_varlen_out_broadcast_views_are_refused():
    (q, k, v), lens = _varlen("bcast")
    with pytest.raises(ValueError, match="out has stride 0"):
        cuflash.attention_varlen(q, k, v, *lens, out=_broadcast_writeable((10, 4, 8)))
    o = np.empty((10, 4, 8), np.float32)
    with pytest.raises(ValueError, match=r"out\[1\] \(lse\) has stride 0"):
        cuflash.attention_varlen(q, k, v, *lens, return_lse=True,
                                 out=(o, _broadcast_writeable((4, 10))))


def test_kvcache_out_broadcast_view_is_refused():
    q, kc, vc, lens = _kvcache("bcast")
    with pytest.raises(ValueError, match="out has stride 0"):
        cuflash.attention_with_kvcache(q, kc, vc, lens, out=_broadcast_writeable((3, 2, 4, 8)))


# -- output buffers that share memory with one another -------------------------------------


def _pair_in_one_buffer(o_shape, lse_shape, *, overlap):
    """(o, lse) views of one float32 buffer: lse on o's first elements (overlap) or after o."""
    n_o, n_l = int(np.prod(o_shape)), int(np.prod(lse_shape))
    buf = np.full(n_o + n_l, np.nan, np.float32)
    o = buf[:n_o].reshape(o_shape)
    lse = (buf[:n_l] if overlap else buf[n_o:]).reshape(lse_shape)
    return o, lse


def test_attention_out_pair_must_not_overlap():
    q, k, v = _dense("pair")
    o, lse = _pair_in_one_buffer((2, 3, 10, 8), (2, 3, 10), overlap=True)
    with pytest.raises(ValueError, match=r"out\[0\] \(o\) and out\[1\] \(lse\) overlap"):
        cuflash.attention(q, k, v, return_lse=True, out=(o, lse))
    # two disjoint parts of one buffer are fine, and are written with the right values
    o, lse = _pair_in_one_buffer((2, 3, 10, 8), (2, 3, 10), overlap=False)
    res = cuflash.attention(q, k, v, causal=True, return_lse=True, out=(o, lse))
    assert res[0] is o and res[1] is lse
    o_ref, lse_ref = reference.attention_ref(q, k, v, causal=True)
    assert reference.pass_threshold(q, k, v, causal=True, dtype="float32",
                                    o_ref=o_ref).judge(o.astype(np.float64)).passed
    np.testing.assert_allclose(lse, lse_ref, rtol=1e-5, atol=1e-5)


def test_varlen_and_kvcache_out_pairs_must_not_overlap():
    (q, k, v), lens = _varlen("pair")
    o, lse = _pair_in_one_buffer((10, 4, 8), (4, 10), overlap=True)
    with pytest.raises(ValueError, match="overlap"):
        cuflash.attention_varlen(q, k, v, *lens, return_lse=True, out=(o, lse))
    q, kc, vc, sl = _kvcache("pair")
    o, lse = _pair_in_one_buffer((3, 2, 4, 8), (3, 4, 2), overlap=True)
    with pytest.raises(ValueError, match="overlap"):
        cuflash.attention_with_kvcache(q, kc, vc, sl, return_lse=True, out=(o, lse))


def _dense_backward(key):
    q, k, v = _dense(key)
    v = np.ascontiguousarray(np.concatenate([v, v], axis=-1))   # Dv = D: dk and dv alike
    o, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
    do = _arr(case_rng(SEED, "api_buffers_do", key), *o.shape)
    return do, q, k, v, o, lse


def test_backward_grads_must_not_overlap():
    do, q, k, v, o, lse = _dense_backward("grads")
    shared = np.empty_like(k)
    with pytest.raises(ValueError, match=r"out\[1\] \(dk\) and out\[2\] \(dv\) overlap"):
        cuflash.attention_backward(do, q, k, v, o, lse, causal=True,
                                   out=(np.empty_like(q), shared, shared))
    # dk and dv as the two disjoint halves of one buffer: accepted and right
    both = np.full((2,) + k.shape, np.nan, k.dtype)
    grads = cuflash.attention_backward(do, q, k, v, o, lse, causal=True,
                                       out=(np.empty_like(q), both[0], both[1]))
    want = cuflash.attention_backward(do, q, k, v, o, lse, causal=True)
    for got, ref in zip(grads, want):
        np.testing.assert_array_equal(got, ref)


def test_varlen_backward_grads_must_not_overlap():
    (q, k, v), lens = _varlen("grads")
    v = np.ascontiguousarray(np.concatenate([v, v], axis=-1))
    o, lse = cuflash.attention_varlen(q, k, v, *lens, return_lse=True)
    do = _arr(case_rng(SEED, "api_buffers_vdo"), *o.shape)
    shared = np.empty_like(k)
    with pytest.raises(ValueError, match="overlap"):
        cuflash.attention_varlen_backward(do, q, k, v, o, lse, *lens,
                                          out=(np.empty_like(q), shared, shared))


# -- an out triple with a missing buffer ---------------------------------------------------


def test_backward_out_triple_with_none_is_refused_up_front():
    do, q, k, v, o, lse = _dense_backward("none")
    with pytest.raises(ValueError, match=r"out\[0\] \(dq\) is None"):
        cuflash.attention_backward(do, q, k, v, o, lse, out=(None, np.empty_like(k),
                                                             np.empty_like(v)))
    (q, k, v), lens = _varlen("none")
    o, lse = cuflash.attention_varlen(q, k, v, *lens, return_lse=True)
    with pytest.raises(ValueError, match=r"out\[2\] \(dv\) is None"):
        cuflash.attention_varlen_backward(o, q, k, v, o, lse, *lens,
                                          out=(np.empty_like(q), np.empty_like(k), None))


# -- the cache appended into -----------------------------------------------------------------


def test_kvcache_append_needs_writeable_caches_and_writes_nothing_otherwise():
    q, kc, vc, lens = _kvcache("append")
    rng = case_rng(SEED, "api_buffers_new")
    k_new, v_new = _arr(rng, 3, 2, 2, 16), _arr(rng, 3, 2, 2, 8)
    kc0 = kc.copy()
    vc.flags.writeable = False
    with pytest.raises(ValueError, match="v_cache is read-only"):
        cuflash.attention_with_kvcache(q, kc, vc, lens, k_new=k_new, v_new=v_new)
    np.testing.assert_array_equal(kc, kc0)   # nothing appended before the error
    # a cache whose batch entries share memory would take every sequence's keys in one place
    shared = as_strided(kc0[:1].copy(), kc0.shape, (0,) + kc0.strides[1:])
    with pytest.raises(ValueError, match="k_cache has stride 0"):
        cuflash.attention_with_kvcache(q, shared, vc.copy(), lens, k_new=k_new, v_new=v_new)
    # without k_new nothing is written: a read-only cache is fine
    o = cuflash.attention_with_kvcache(q, kc, vc, lens)
    o_ref, _ = reference.attention_with_kvcache_ref(q, kc, vc, lens)
    assert np.max(np.abs(o - o_ref)) < 1e-5


# -- the GPU path's host-side checks (stand-in CuPy) -----------------------------------------


def test_gpu_out_checks(fake):
    """GPU inputs: a broadcast out and an (o, lse) pair whose memory overlaps raise before any
    launch, on the full path and, after the same signature was recorded with disjoint buffers,
    on what would be a call-cache hit (it falls back to the full path, which raises)."""
    rec = fake
    q, k, v = (FakeArray((2, 4, 100, 64), ptr=(1 << 20) + i * (1 << 24)) for i in range(3))
    bcast = FakeArray((2, 4, 100, 64), ptr=1 << 33, strides=(0, 100 * 64 * 2, 64 * 2, 2))
    with pytest.raises(ValueError, match="out has stride 0"):
        cuflash.attention(q, k, v, out=bcast)
    o = FakeArray((2, 4, 100, 64), ptr=1 << 34)
    lse_apart = FakeArray((2, 4, 100), "float32", ptr=(1 << 34) + o.nbytes)
    cuflash.attention(q, k, v, return_lse=True, out=(o, lse_apart))   # recorded
    n = len(rec["launches"])
    lse_on_o = FakeArray((2, 4, 100), "float32", ptr=(1 << 34) + 256)
    with pytest.raises(ValueError, match="overlap"):
        cuflash.attention(q, k, v, return_lse=True, out=(o, lse_on_o))
    assert len(rec["launches"]) == n, "nothing may be launched"
    cuflash.attention(q, k, v, return_lse=True, out=(o, lse_apart))   # the hit still works
    assert len(rec["launches"]) == n + 1


def test_gpu_kvcache_hit_with_overlapping_buffers_takes_the_full_path(kvfake):
    """attention_with_kvcache on GPU arrays: a recorded signature called again with an (o, lse)
    pair sharing memory is refused by the full path's checks, not launched as a hit."""
    from test_kvcache_callcache import _args

    (q, kc, vc, lens), kw = _args(False, "array", 1)
    o = FakeArray((2, 1, 8, 64), ptr=1 << 36)
    lse = FakeArray((2, 8, 1), "float32", ptr=(1 << 36) + o.nbytes)
    cuflash.attention_with_kvcache(q, kc, vc, lens, return_lse=True, out=(o, lse), **kw)
    assert kvfake["kvchecks"] == 1
    n = len(kvfake["launches"])
    lse_on_o = FakeArray((2, 8, 1), "float32", ptr=(1 << 36) + 64)
    with pytest.raises(ValueError, match=r"out\[0\] \(o\) and out\[1\] \(lse\) overlap"):
        cuflash.attention_with_kvcache(q, kc, vc, lens, return_lse=True, out=(o, lse_on_o), **kw)
    assert len(kvfake["launches"]) == n and kvfake["kvchecks"] == 2
    cuflash.attention_with_kvcache(q, kc, vc, lens, return_lse=True, out=(o, lse), **kw)
    assert kvfake["kvchecks"] == 2 and len(kvfake["launches"]) > n   # the hit
