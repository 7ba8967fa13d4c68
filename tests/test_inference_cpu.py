"""CPU tests of the inference features (issue 14): grouped-query heads through `attention` and
`attention_backward`, and the float64 references' grouping rule, against an explicit
head-repeat (np.repeat) that does not use the broadcast split."""
import numpy as np
import pytest

import cuflash
from cuflash import reference

from seeds import SEED, case_rng  # noqa: E402  (fresh every run; see pytest's header)


def _rng(*key):
    return case_rng(SEED, *key)


def _inputs(rng, qshape, kshape, vshape, dtype):
    return tuple(reference.round_to(rng.standard_normal(s), dtype) for s in (qshape, kshape, vshape))


def _repeat_heads(x, h):
    """x (..., Hkv, S, D) with each head repeated H / Hkv times: the GQA rule written out."""
    return np.repeat(x, h // x.shape[-3], axis=-3) if x.ndim >= 3 else x


@pytest.mark.parametrize("group", [1, 4, 8, 32])
@pytest.mark.parametrize("causal", [False, True])
def test_reference_grouping_is_head_repeat(group, causal):
    rng = _rng("ref", group, causal)
    hkv = 32 // group if group < 32 else 1
    h = hkv * group
    q, k, v = _inputs(rng, (2, h, 5, 16), (2, hkv, 7, 16), (2, hkv, 7, 8), "float64")
    o, lse = reference.attention_ref(q, k, v, causal=causal)
    o2, lse2 = reference.attention_ref(q, _repeat_heads(k, h), _repeat_heads(v, h), causal=causal)
    assert o.shape == (2, h, 5, 8) and lse.shape == (2, h, 5)
    np.testing.assert_array_equal(o, o2)
    np.testing.assert_array_equal(lse, lse2)
    do = rng.standard_normal(o.shape)
    dq, dk, dv = reference.attention_backward_ref(do, q, k, v, causal=causal)
    dq2, dk2, dv2 = reference.attention_backward_ref(do, q, _repeat_heads(k, h),
                                                     _repeat_heads(v, h), causal=causal)
    assert dk.shape == k.shape and dv.shape == v.shape
    np.testing.assert_allclose(dq, dq2, rtol=0, atol=1e-13)
    sum_groups = lambda x: x.reshape(2, hkv, group, *x.shape[-2:]).sum(axis=2)  # noqa: E731
    np.testing.assert_allclose(dk, sum_groups(dk2), rtol=0, atol=1e-13)
    np.testing.assert_allclose(dv, sum_groups(dv2), rtol=0, atol=1e-13)


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("h,hkv,sq,sk", [(8, 2, 1, 1000), (32, 8, 7, 113), (4, 1, 113, 7),
                                         (32, 1, 3, 64), (6, 3, 1, 1)])
def test_cpu_forward_gqa(h, hkv, sq, sk, causal, dtype):
    rng = _rng("fwd", h, hkv, sq, sk, causal, dtype)
    q, k, v = _inputs(rng, (2, h, sq, 32), (2, hkv, sk, 32), (2, hkv, sk, 32), dtype)
    o = np.full((2, h, sq, 32), np.nan, dtype=dtype)
    lse = np.full((2, h, sq), np.nan, dtype=np.float32)
    res = cuflash.attention(q.astype(dtype), k.astype(dtype), v.astype(dtype), causal=causal,
                            return_lse=True, out=(o, lse))
    assert res[0] is o and res[1] is lse
    rule = reference.pass_threshold(q, _repeat_heads(k, h), _repeat_heads(v, h), causal=causal,
                                    dtype=dtype)
    verdict = rule.judge(o.astype(np.float64))
    assert verdict.passed, verdict.reasons
    _, lse_ref = reference.attention_ref(q, k, v, causal=causal)
    fin = np.isfinite(lse_ref)
    assert np.array_equal(np.isneginf(lse), ~fin)
    assert np.all(np.abs(lse[fin] - lse_ref[fin]) <= 1e-4 + 1e-5 * np.abs(lse_ref[fin]))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("causal", [False, True])
def test_cpu_backward_gqa(dtype, causal):
    rng = _rng("bwd", dtype, causal)
    h, hkv = 8, 2
    q, k, v = _inputs(rng, (2, h, 9, 16), (2, hkv, 20, 16), (2, hkv, 20, 16), dtype)
    do = reference.round_to(rng.standard_normal((2, h, 9, 16)), dtype)
    args = [x.astype(dtype) for x in (q, k, v)]
    o, lse = cuflash.attention(*args, causal=causal, return_lse=True)
    outs = tuple(np.full(x.shape, np.nan, dtype=dtype) for x in (q, k, v))
    grads = cuflash.attention_backward(do.astype(dtype), *args, o, lse, causal=causal, out=outs)
    assert all(g is b for g, b in zip(grads, outs))
    ref = reference.attention_backward_ref(do, q, k, v, causal=causal)
    tols, _ = reference.grad_pass_threshold(do, q, k, v, causal=causal, dtype=dtype, ref=ref)
    for name, g, r, t in zip(("dq", "dk", "dv"), grads, ref, tols):
        assert g.shape == r.shape
        err = np.abs(g.astype(np.float64) - r).max()
        assert err <= t, f"{name}: {err:.3e} > {t:.3e}"


def test_gqa_bshd_layout_and_broadcast_batch():
    """(B, S, H, D) buffers passed as transposed views, and a kv without the batch axis."""
    rng = _rng("layout")
    q = rng.standard_normal((2, 5, 8, 16)).transpose(0, 2, 1, 3)   # (B, H, S, D) view
    k = rng.standard_normal((11, 2, 16)).transpose(1, 0, 2)        # (Hkv, Sk, D) view
    v = rng.standard_normal((11, 2, 16)).transpose(1, 0, 2)
    o = cuflash.attention(q, k, v)
    o_ref, _ = reference.attention_ref(np.ascontiguousarray(q), _repeat_heads(k, 8),
                                       _repeat_heads(v, 8))
    assert o.shape == (2, 8, 5, 16)
    np.testing.assert_allclose(o, o_ref, rtol=0, atol=1e-12)


def test_gqa_errors():
    q = np.zeros((2, 8, 4, 16), np.float32) + 1
    k3 = np.ones((2, 3, 4, 16), np.float32)
    with pytest.raises(ValueError, match="multiple of the key/value heads"):
        cuflash.attention(q, k3, k3)
    with pytest.raises(ValueError, match="multiple of the key/value heads"):
        cuflash.attention(q[:, :4], np.ones((2, 8, 4, 16), np.float32),
                          np.ones((2, 8, 4, 16), np.float32))
    k2, k4 = (np.ones((2, n, 4, 16), np.float32) for n in (2, 4))
    with pytest.raises(ValueError, match="different numbers of grouped heads"):
        cuflash.attention(q, k2, k4)
    with pytest.raises(ValueError, match="out has shape"):
        cuflash.attention(q, k2, k2, out=np.empty((2, 2, 4, 4, 16), np.float32))
    o, lse = cuflash.attention(q, k2, k2, return_lse=True)
    with pytest.raises(ValueError, match="lse has shape"):
        cuflash.attention_backward(o, q, k2, k2, o, lse[:, :2])


def test_plain_broadcast_still_works():
    """A query head axis of size 1 against many kv heads is plain broadcasting, not grouping."""
    rng = _rng("bcast")
    q, k, v = (rng.standard_normal(s) for s in ((1, 1, 3, 8), (1, 4, 6, 8), (1, 4, 6, 8)))
    o = cuflash.attention(q, k, v)
    np.testing.assert_allclose(o, reference.attention_ref(q, k, v)[0], rtol=0, atol=1e-12)
    assert o.shape == (1, 4, 3, 8)


# ---------------------------------------------------------------------------------------------
# attention_with_kvcache, CPU path

from kvcache_util import check_kvcache_result, random_kv_problem  # noqa: E402


@pytest.mark.parametrize("page", [None, 16, 32, 256])
@pytest.mark.parametrize("snew", [0, 1, 5])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("group", [1, 4])
def test_kvcache_cpu(page, snew, causal, group):
    dtype = "float32"
    rng = _rng("kv", page, snew, causal, group)
    b, hkv, d, sq = 4, 2, 16, 3
    lens = np.array([0, 1, 15, 40], np.int32)   # empty, one key, an append crossing a page
    q, k, v, bt, kn, vn = random_kv_problem(rng, b=b, hkv=hkv, group=group, sq=sq, d=d,
                                            lens=lens, snew=snew, page=page, dtype=dtype)
    k32, v32 = k.astype(dtype), v.astype(dtype)
    o = np.full((b, sq, hkv * group, d), np.nan, dtype)
    lse = np.full((b, hkv * group, sq), np.nan, np.float32)
    res = cuflash.attention_with_kvcache(
        q.astype(dtype), k32, v32, lens, block_table=bt,
        k_new=None if kn is None else kn.astype(dtype),
        v_new=None if vn is None else vn.astype(dtype), causal=causal, return_lse=True,
        out=(o, lse))
    assert res[0] is o and res[1] is lse
    check_kvcache_result(o.astype(np.float64), lse.astype(np.float64), q, k, v, lens,
                         block_table=bt, k_new=kn, v_new=vn, causal=causal, dtype=dtype)
    if snew:  # appended in place
        for i in range(b):
            k_i, v_i = reference.gather_kv_cache(k32, v32, int(lens[i]) + snew, i, bt)
            np.testing.assert_array_equal(k_i[lens[i]:], kn[i].astype(dtype))
            np.testing.assert_array_equal(v_i[lens[i]:], vn[i].astype(dtype))


def test_kvcache_errors():
    q = np.ones((2, 1, 8, 16), np.float32)
    kc = np.ones((2, 32, 2, 16), np.float32)
    lens = np.array([3, 4], np.int32)
    with pytest.raises(ValueError, match="multiple of the key/value heads"):
        cuflash.attention_with_kvcache(q[:, :, :3], kc, kc, lens)
    with pytest.raises(TypeError, match="cache_seqlens has dtype int64"):
        cuflash.attention_with_kvcache(q, kc, kc, lens.astype(np.int64))
    with pytest.raises(ValueError, match="power of two"):
        cuflash.attention_with_kvcache(q, np.ones((4, 24, 2, 16), np.float32),
                                       np.ones((4, 24, 2, 16), np.float32), lens,
                                       block_table=np.zeros((2, 2), np.int32))
    with pytest.raises(ValueError, match="lie in"):
        cuflash.attention_with_kvcache(q, kc, kc, np.array([3, 33], np.int32))
    with pytest.raises(ValueError, match="lie in"):
        cuflash.attention_with_kvcache(q, kc, kc, np.array([30, 3], np.int32),
                                       k_new=np.ones((2, 3, 2, 16), np.float32),
                                       v_new=np.ones((2, 3, 2, 16), np.float32))
    with pytest.raises(ValueError, match="both or neither"):
        cuflash.attention_with_kvcache(q, kc, kc, lens, k_new=np.ones((2, 1, 2, 16), np.float32))
    with pytest.raises(ValueError, match="names pages outside"):
        cuflash.attention_with_kvcache(q, np.ones((4, 16, 2, 16), np.float32),
                                       np.ones((4, 16, 2, 16), np.float32), lens,
                                       block_table=np.array([[0], [7]], np.int32))
    with pytest.raises(ValueError, match="inputs are on the CPU"):
        cuflash.attention_with_kvcache(q, kc, kc, lens, kernel="decode")


# ---------------------------------------------------------------------------------------------
# attention_varlen, CPU path

from varlen_util import check_varlen_result, make_varlen  # noqa: E402


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("h,hkv", [(4, 4), (8, 2)])
def test_varlen_cpu(h, hkv, dtype, causal):
    rng = _rng("varlen", h, hkv, dtype, causal)
    lens_q = np.array([1, 7, 0, 113, 30])
    lens_k = np.array([1, 7, 5, 113, 50])      # Sq != Sk in the last; an empty query set
    q, k, v, cu_q, cu_k = make_varlen(rng, lens_q, lens_k, h, hkv, 16, dtype)
    o = np.full((q.shape[0], h, 16), np.nan, dtype)
    lse = np.full((h, q.shape[0]), np.nan, np.float32)
    res = cuflash.attention_varlen(q.astype(dtype), k.astype(dtype), v.astype(dtype), cu_q, cu_k,
                                   113, 113, causal=causal, return_lse=True, out=(o, lse))
    assert res[0] is o and res[1] is lse
    check_varlen_result(o.astype(np.float64), lse.astype(np.float64), q, k, v, cu_q, cu_k,
                        causal=causal, dtype=dtype)


def test_varlen_errors():
    q = np.ones((10, 4, 16), np.float32)
    cu = np.array([0, 4, 10], np.int32)
    with pytest.raises(TypeError, match="cu_seqlens_q has dtype int64"):
        cuflash.attention_varlen(q, q, q, cu.astype(np.int64), cu, 6, 6)
    with pytest.raises(ValueError, match="must start at 0"):
        cuflash.attention_varlen(q, q, q, np.array([0, 4, 11], np.int32), cu, 7, 6)
    with pytest.raises(ValueError, match="more than max_seqlen"):
        cuflash.attention_varlen(q, q, q, cu, cu, 5, 6)
    with pytest.raises(ValueError, match="B \\+ 1 >= 2"):
        cuflash.attention_varlen(q, q, q, cu, cu[:2], 6, 6)
    with pytest.raises(ValueError, match="total_tokens"):
        cuflash.attention_varlen(q[None], q, q, cu, cu, 6, 6)
    with pytest.raises(ValueError, match="multiple of the key/value heads"):
        cuflash.attention_varlen(q, q[:, :3], q[:, :3], cu, cu, 6, 6)


# ---------------------------------------------------------------------------------------------
# The decode kernel's host side (no GPU needed)

def test_decode_param_blocks_mirror_the_kernel_structs():
    import re

    from cuflash import _decode
    from kernels_cu import SOURCE_DIR

    src = (SOURCE_DIR / "attn_decode.cu").read_text()
    for struct, dt in (("DecodeParams", _decode.DECODE_PARAMS_DTYPE),
                       ("AppendParams", _decode.APPEND_PARAMS_DTYPE)):
        n = int(re.search(rf"sizeof\({struct}\) == (\d+) \* 8", src).group(1))
        assert dt.itemsize == 8 * n and len(dt.names) == n, struct
        body = re.search(rf"struct {struct} {{(.*?)\n}};", src, re.S).group(1)
        fields = re.findall(r"(\w+)(?:,|;)", re.sub(r"//[^\n]*", "", body))
        assert tuple(fields) == dt.names, struct


@pytest.mark.parametrize("entries,tiles,sms", [(8, 8192, 132), (512, 512, 132), (1, 1, 132),
                                               (32, 64, 108), (4096, 4, 132)])
def test_choose_splits(entries, tiles, sms):
    from cuflash import _decode

    s = _decode.choose_splits(entries, tiles, sms, 3, 8192)
    assert s == _decode.choose_splits(entries, tiles, sms, 3, 8192)  # a function of its inputs
    assert 1 <= s <= _decode.MAX_SPLITS
    assert s == 1 or -(-tiles // s) >= _decode.DECODE_WARPS * _decode.MIN_TILES_PER_WARP // 2


def test_gqa_audit_judges_the_tf32_mode_by_its_own_rule():
    """The grouped-query property audit passes the call's float32 precision mode to the rule (an
    H200 run failed "tensorcore/high" against the float32-accurate rule): a one-pass TF32 result
    passes as "tensorcore/high" and fails as the default mode."""
    from cuflash import _audit_inference

    rng = np.random.default_rng(20261201)
    q = reference.round_to(2.0 * rng.standard_normal((8, 37, 64)), "float32")
    k, v = (reference.round_to(rng.standard_normal((8, 300, 64)), "float32") for _ in range(2))
    o = reference.naive_attention(q, k, v, causal=True, dtype="float32", precision="high")
    _, lse = reference.attention_ref(q, k, v, causal=True)
    _, _, ok_high, why = _audit_inference._sequence_verdict("float32", o, lse, q, k, v, True,
                                                            "tensorcore/high")
    assert ok_high, why
    _, _, ok_default, _ = _audit_inference._sequence_verdict("float32", o, lse, q, k, v, True,
                                                             "tensorcore")
    assert not ok_default


def test_choose_splits_sees_changed_constants(monkeypatch):
    """The split count is cached, but per model constants too: a changed MAX_SPLITS or cost
    constant is used at once, not an earlier call's result."""
    from cuflash import _decode

    many = _decode.choose_splits(1, 8192, 132, 3, 8192)
    assert many > 2
    monkeypatch.setattr(_decode, "MAX_SPLITS", 2)
    assert _decode.choose_splits(1, 8192, 132, 3, 8192) == 2
    monkeypatch.setattr(_decode, "MAX_SPLITS", 256)
    monkeypatch.setattr(_decode, "DECODE_T_COMBINE", 1.0)   # a combine costlier than any split
    assert _decode.choose_splits(1, 8192, 132, 3, 8192, version=1) == 1
    assert _decode.choose_splits(1, 8192, 132, 3, 8192, version=2) > 2   # not version 2's
    monkeypatch.setattr(_decode, "DECODE_T_COMBINE_V2", 1.0)
    assert _decode.choose_splits(1, 8192, 132, 3, 8192, version=2) == 1
