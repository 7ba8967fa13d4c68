"""GPU tests of the inference features (issue 14) against the float64 reference, on fresh random
inputs, with every output poisoned with NaN so an unwritten element fails. Skipped without a GPU."""
import math

import numpy as np
import pytest

import cuflash
from cuflash import reference

from gpu_util import (bf16_dtype, check_against_reference, check_grads_against_reference, cupy,
                      poisoned, to_gpu, to_host64)

pytestmark = pytest.mark.gpu

from seeds import SEED, case_rng  # noqa: E402  (fresh every run; see pytest's header)


def _rng(*key):
    return case_rng(SEED, *key)


def _skip(dtype):
    if dtype == "bfloat16" and bf16_dtype() is None:
        pytest.skip("bfloat16 on the GPU needs ml_dtypes (CuPy's bfloat16 dtype)")


def _cc():
    return int(cupy().cuda.Device().compute_capability)


def _kernels():
    ks = ["auto", "generic"]
    if cuflash.gpu_available() and _cc() >= 80:
        ks.append("tensorcore")
    if cuflash.gpu_available() and _cc() == 90:
        ks.append("hopper")
    return ks


def _rnd(rng, shape, dtype):
    return reference.round_to(rng.standard_normal(shape), dtype)


# ---------------------------------------------------------------------------------------------
# Grouped-query heads through `attention` and `attention_backward`

@pytest.mark.parametrize("kernel", ["auto", "generic", "tensorcore", "hopper"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("h,hkv,sq,sk", [(32, 32, 1, 1000), (32, 8, 1, 113), (32, 1, 7, 1000),
                                         (8, 2, 113, 1000), (32, 4, 1000, 7)])
def test_gqa_forward(h, hkv, sq, sk, dtype, causal, kernel):
    _skip(dtype)
    if kernel not in _kernels():
        pytest.skip(f"kernel={kernel!r} does not run on this GPU")
    if kernel == "hopper" and dtype == "float32":
        pytest.skip("the Hopper kernel takes 16-bit inputs")
    rng = _rng("gqa", h, hkv, sq, sk, dtype, causal, kernel)
    d = 128 if sq * sk < 100000 else 64
    q, k, v = (_rnd(rng, s, dtype) for s in ((2, h, sq, d), (2, hkv, sk, d), (2, hkv, sk, d)))
    # q as a (B, S, H, D) buffer seen through a transposed view
    qg = to_gpu(np.ascontiguousarray(q.transpose(0, 2, 1, 3)), dtype).transpose(0, 2, 1, 3)
    kg, vg = to_gpu(k, dtype), to_gpu(v, dtype)
    o, lse = poisoned((2, h, sq, d), dtype), poisoned((2, h, sq), "float32")
    res = cuflash.attention(qg, kg, vg, causal=causal, return_lse=True, out=(o, lse),
                            kernel=kernel)
    assert res[0] is o and res[1] is lse
    cupy().cuda.get_current_stream().synchronize()
    check_against_reference(o, lse, q, k, v, causal=causal, scale=1 / math.sqrt(d), dtype=dtype)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
@pytest.mark.parametrize("h,hkv,sq,sk", [(8, 2, 7, 113), (32, 8, 1, 1000), (4, 1, 113, 7)])
def test_gqa_backward(h, hkv, sq, sk, dtype, causal):
    rng = _rng("gqa-bwd", h, hkv, sq, sk, dtype, causal)
    d = 64
    q, k, v = (_rnd(rng, s, dtype) for s in ((2, h, sq, d), (2, hkv, sk, d), (2, hkv, sk, d)))
    do = _rnd(rng, (2, h, sq, d), dtype)
    qg, kg, vg, dog = (to_gpu(x, dtype) for x in (q, k, v, do))
    o, lse = cuflash.attention(qg, kg, vg, causal=causal, return_lse=True)
    outs = tuple(poisoned(x.shape, dtype) for x in (q, k, v))
    grads = cuflash.attention_backward(dog, qg, kg, vg, o, lse, causal=causal, out=outs)
    assert all(g is b for g, b in zip(grads, outs))
    cupy().cuda.get_current_stream().synchronize()
    check_grads_against_reference(grads, do, q, k, v, causal=causal, scale=1 / math.sqrt(d),
                                  dtype=dtype, label="gqa")


# ---------------------------------------------------------------------------------------------
# The decode kernel (kernels_cu/attn_decode.cu) through `attention(kernel="decode")`

DECODE_CASES = [  # (B, H, Hkv, Sq, Sk, D)
    (1, 32, 8, 1, 1000, 128),    # B = 1: many splits
    (2, 32, 32, 1, 113, 128),    # plain multi-head, tail tile
    (3, 32, 1, 1, 7, 64),        # one kv head, 32 query heads: two row tiles
    (2, 8, 2, 7, 1000, 256),     # Sq > 1
    (1, 4, 4, 1, 1, 128),        # one key
    (2, 16, 4, 16, 300, 96),     # 64 packed rows, padded head dim
    (1, 32, 4, 3, 8192, 128),    # long keys, 24 rows, splits
    (2, 32, 1, 2, 1000, 128),    # 64 packed rows: two blocks of two row tiles (MT = 2)
    (1, 32, 1, 1, 65536, 128),   # MQA, long keys: 32 rows in one block, many splits
    (2, 64, 8, 3, 113, 64),      # 24 rows: MT = 2 with a part-filled second tile
]


def _decode_version(monkeypatch, version):
    """Run the decode family at kernel `version` (1: session f's kernels and split rule, kept
    selectable for timing; 2: the default; 3: 2 with the L2::256B prefetch hint; 4: 2 with
    bulk copies, sm_90 only; 5: 2 with an evict-first L2 policy on the K/V copies; 6: 2 with
    swizzled K/V tiles; 7: 2 with three K/V stages per warp at MT = 2; 8: 6 with combine
    version 3, a warp a packed row, at up to 16 splits)."""
    from cuflash import _decode

    if version == 4 and _cc() != 90:
        pytest.skip("decode kernel version 4 (cp.async.bulk) runs on sm_90 only")
    monkeypatch.setattr(_decode, "DECODE_VERSION", version)


@pytest.mark.parametrize("version", [2, 1, 3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("b,h,hkv,sq,sk,d", DECODE_CASES)
def test_decode_kernel(b, h, hkv, sq, sk, d, dtype, causal, version, monkeypatch):
    _skip(dtype)
    if _cc() < 80:
        pytest.skip("the decode kernel needs compute capability 8.0")
    _decode_version(monkeypatch, version)
    rng = _rng("decode", b, h, hkv, sq, sk, d, dtype, causal, version)
    q, k, v = (_rnd(rng, s, dtype) for s in ((b, h, sq, d), (b, hkv, sk, d), (b, hkv, sk, d)))
    # K and V as (B, Sk, Hkv, D) cache-like buffers seen through transposed views
    qg = to_gpu(q, dtype)
    kg = to_gpu(np.ascontiguousarray(k.transpose(0, 2, 1, 3)), dtype).transpose(0, 2, 1, 3)
    vg = to_gpu(np.ascontiguousarray(v.transpose(0, 2, 1, 3)), dtype).transpose(0, 2, 1, 3)
    from cuflash import _decode

    info = cuflash.dispatch_info(qg, kg, vg, causal=causal, kernel="decode")
    # the label names the version (",vN"; none for 2) and then the split rule (",rule4" under
    # the default rule; version 1 keeps its own rule and no suffix)
    rule = _decode.DECODE_SPLIT_RULE
    want = ("" if version == 2 else f",v{version}") + \
        ("" if version == 1 or rule == 2 else f",rule{rule}")
    assert info.startswith("decode<") and info.endswith(want + ">"), (info, want)
    o, lse = poisoned((b, h, sq, d), dtype), poisoned((b, h, sq), "float32")
    cuflash.attention(qg, kg, vg, causal=causal, return_lse=True, out=(o, lse), kernel="decode")
    o2 = cuflash.attention(qg, kg, vg, causal=causal, kernel="decode")
    cupy().cuda.get_current_stream().synchronize()
    check_against_reference(o, lse, q, k, v, causal=causal, scale=1 / math.sqrt(d), dtype=dtype)
    assert cupy().array_equal(o.view(cupy().uint16), o2.view(cupy().uint16)), \
        "decode results differ between two runs"


def test_decode_is_auto_for_single_token_gqa():
    if _cc() < 80:
        pytest.skip("the decode kernel needs compute capability 8.0")
    cp = cupy()
    q = cp.ones((1, 32, 1, 128), cp.float16)
    k = cp.ones((1, 8, 4096, 128), cp.float16)
    assert cuflash.dispatch_info(q, k, k).startswith("decode<float16,D128,BN16,W4,dense")
    k1 = cp.ones((1, 1, 4096, 128), cp.float16)   # 32 query heads on one kv head: MT = 2
    assert cuflash.dispatch_info(q, k1, k1).startswith("decode<float16,D128,BN16,W4,R32,")


FORCED_CASES = [  # (H, Hkv, Sq): groups 1, 4, 8, 32; Sq = 1 and > 1; MT = 1 and 2
    (32, 32, 1), (32, 8, 1), (32, 4, 1), (32, 1, 1), (32, 4, 3), (32, 1, 2)]


@pytest.mark.parametrize("version", [8, 2, 1, 4, 6, 7])   # 3: test_decode_kernel, the bitwise test
@pytest.mark.parametrize("splits", [1, 100, "max"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sk", [1, 7, 113, 1000, 20000])
@pytest.mark.parametrize("h,hkv,sq", FORCED_CASES)
def test_decode_forced_splits(h, hkv, sq, sk, causal, splits, version, monkeypatch):
    """The split count forced to its extremes (one split: no combine; "max": one key tile per
    split, so most warps of a split have no tile and, causal, trailing splits no key) and to
    100 (version 2's combine on 4 column blocks a row at D = 128; "max" at Sk = 20000: 250
    splits on 8; Sk = 1000: 63 splits on 2), against float64, NaN-poisoned outputs, bitwise
    equal run to run."""
    if _cc() < 80:
        pytest.skip("the decode kernel needs compute capability 8.0")
    from cuflash import _decode

    _decode_version(monkeypatch, version)
    monkeypatch.setattr(_decode, "choose_splits",
                        lambda *a, **kw: _decode.MAX_SPLITS if splits == "max" else splits)
    rng = _rng("decode-forced", h, hkv, sq, sk, causal, splits, version)
    d, b = 128, 2
    q, k, v = (_rnd(rng, s, "float16") for s in ((b, h, sq, d), (b, hkv, sk, d),
                                                  (b, hkv, sk, d)))
    qg, kg, vg = (to_gpu(x, "float16") for x in (q, k, v))
    o, lse = poisoned((b, h, sq, d), "float16"), poisoned((b, h, sq), "float32")
    cuflash.attention(qg, kg, vg, causal=causal, return_lse=True, out=(o, lse), kernel="decode")
    o2 = cuflash.attention(qg, kg, vg, causal=causal, kernel="decode")
    cupy().cuda.get_current_stream().synchronize()
    check_against_reference(o, lse, q, k, v, causal=causal, scale=1 / math.sqrt(d),
                            dtype="float16")
    assert cupy().array_equal(o.view(cupy().uint16), o2.view(cupy().uint16))


# ---------------------------------------------------------------------------------------------
# attention_with_kvcache on the GPU (decode kernel through the block table, in-place append)

from kvcache_util import (check_appended, check_kvcache_result, make_cache,  # noqa: E402
                          random_kv_problem)

KV_CASES = [  # (page or None, group, Sq, Snew, lens)
    (None, 4, 1, 0, (0, 1, 7, 1000)),
    (None, 8, 1, 1, (0, 1, 113, 5000)),
    (16, 1, 1, 1, (0, 15, 16, 1000)),      # appends at a page end and crossing one
    (16, 4, 4, 4, (1, 14, 30, 3000)),      # Sq > 1 with as many new keys (speculative)
    (32, 8, 1, 0, (1, 7, 113, 1000)),
    (64, 32, 2, 3, (0, 62, 63, 2000)),     # group of 32: 64 packed rows
    (256, 4, 1, 1, (255, 1, 300, 9000)),
    (16, 4, 16, 16, (0, 5, 200, 1500)),    # 64 packed rows, new keys spanning pages
    (16, 32, 1, 1, (0, 15, 16, 4000)),     # MQA-like group of 32 (MT = 2), page 16, crossing
    (128, 8, 3, 2, (1, 127, 300, 2500)),   # 24 packed rows (MT = 2), Sq > 1
]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("page,group,sq,snew,lens", KV_CASES)
def test_kvcache_gpu(page, group, sq, snew, lens, dtype, causal):
    _skip(dtype)
    if _cc() < 80:
        pytest.skip("the decode kernel needs compute capability 8.0")
    cp = cupy()
    rng = _rng("kvgpu", page, group, sq, snew, lens, dtype, causal)
    hkv, d = 2, 128
    lens = np.array(lens, np.int32)
    b = lens.size
    q, k, v, bt, kn, vn = random_kv_problem(rng, b=b, hkv=hkv, group=group, sq=sq, d=d,
                                            lens=lens, snew=snew, page=page, dtype=dtype)
    kg, vg = to_gpu(k, dtype), to_gpu(v, dtype)
    o, lse = poisoned((b, sq, hkv * group, d), dtype), poisoned((b, hkv * group, sq), "float32")
    res = cuflash.attention_with_kvcache(
        to_gpu(q, dtype), kg, vg, cp.asarray(lens), block_table=None if bt is None else
        cp.asarray(bt), k_new=None if kn is None else to_gpu(kn, dtype),
        v_new=None if vn is None else to_gpu(vn, dtype), causal=causal, return_lse=True,
        out=(o, lse))
    assert res[0] is o and res[1] is lse
    cp.cuda.get_current_stream().synchronize()
    check_kvcache_result(to_host64(o), to_host64(lse), q, k, v, lens, block_table=bt, k_new=kn,
                         v_new=vn, causal=causal, dtype=dtype)
    if snew:  # the append happened in place, into the right pages
        check_appended(to_host64(kg), to_host64(vg), lens, kn, vn, block_table=bt)


@pytest.mark.parametrize("seqlens_int", [False, True])
@pytest.mark.parametrize("page,group,sq,snew,lens", [KV_CASES[1], KV_CASES[2], KV_CASES[3],
                                                     KV_CASES[8]])
def test_kvcache_hits_match_the_reference(page, group, sq, snew, lens, seqlens_int,
                                          monkeypatch):
    """Three calls of one signature on fresh inputs each (the first takes the full path and
    records it, the others the call cache's hit path: `_kvcache._kv_hit`), each against float64
    with NaN-poisoned outputs; an int cache_seqlens (one length for every sequence) too."""
    if _cc() < 80:
        pytest.skip("the decode kernel needs compute capability 8.0")
    from cuflash import _callcache, _kvcache

    cp = cupy()
    checks = []
    real = _kvcache.check_kvcache
    monkeypatch.setattr(_kvcache, "check_kvcache", lambda *a, **kw: checks.append(1) or
                        real(*a, **kw))
    _callcache.clear()
    hkv, d, dtype = 2, 128, "float16"
    lens = np.array(lens, np.int32)
    if seqlens_int:
        lens = np.full_like(lens, int(lens.max()))
    b = lens.size
    for rep in range(3):
        rng = _rng("kvhit", page, group, sq, snew, tuple(lens), seqlens_int, rep)
        q, k, v, bt, kn, vn = random_kv_problem(rng, b=b, hkv=hkv, group=group, sq=sq, d=d,
                                                lens=lens, snew=snew, page=page, dtype=dtype)
        kg, vg = to_gpu(k, dtype), to_gpu(v, dtype)
        o = poisoned((b, sq, hkv * group, d), dtype)
        lse = poisoned((b, hkv * group, sq), "float32")
        res = cuflash.attention_with_kvcache(
            to_gpu(q, dtype), kg, vg, int(lens[0]) if seqlens_int else cp.asarray(lens),
            block_table=None if bt is None else cp.asarray(bt),
            k_new=None if kn is None else to_gpu(kn, dtype),
            v_new=None if vn is None else to_gpu(vn, dtype), return_lse=True, out=(o, lse))
        assert res[0] is o and res[1] is lse
        cp.cuda.get_current_stream().synchronize()
        check_kvcache_result(to_host64(o), to_host64(lse), q, k, v, lens, block_table=bt,
                             k_new=kn, v_new=vn, causal=False, dtype=dtype)
        if snew:
            check_appended(to_host64(kg), to_host64(vg), lens, kn, vn, block_table=bt)
    assert len(checks) == 1, "the second and third calls must be call-cache hits"


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("hkv", [8, 1])   # MT = 1; MT = 2
def test_decode_v3_matches_v2_bitwise(hkv, paged, monkeypatch):
    """Versions 3-6 change only how K/V tiles reach shared memory (the L2 prefetch hint; bulk
    copies per row, sm_90; an evict-first L2 policy; the swizzled layout): their o and lse equal version 2's bit
    for bit (through
    attention_with_kvcache, contiguous and paged page 16, lengths with tails), and version 2's
    pass the float64 reference (test_kvcache_gpu covers the rest)."""
    if _cc() < 80:
        pytest.skip("the decode kernel needs compute capability 8.0")
    cp = cupy()
    rng = _rng("decode-v3", hkv, paged)
    lens = np.array([1, 113, 4000], np.int32)
    q, k, v, bt, kn, vn = random_kv_problem(rng, b=3, hkv=hkv, group=32 // hkv, sq=1, d=128,
                                            lens=lens, snew=0, page=16 if paged else None,
                                            dtype="float16")
    args = (to_gpu(q, "float16"), to_gpu(k, "float16"), to_gpu(v, "float16"), cp.asarray(lens))
    kw = dict(block_table=None if bt is None else cp.asarray(bt), return_lse=True)
    res = {}
    for version in (2, 3, 5, 6, 7) + ((4,) if _cc() == 90 else ()):
        _decode_version(monkeypatch, version)
        res[version] = cuflash.attention_with_kvcache(*args, **kw)
    cp.cuda.get_current_stream().synchronize()
    for version in res:
        assert cp.array_equal(res[2][0].view(cp.uint16), res[version][0].view(cp.uint16)), version
        assert cp.array_equal(res[2][1].view(cp.uint32), res[version][1].view(cp.uint32)), version
    check_kvcache_result(to_host64(res[2][0]), to_host64(res[2][1]), q, k, v, lens,
                         block_table=bt, k_new=None, v_new=None, causal=False, dtype="float16")


@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("causal,sq", [(False, 1), (True, 2)])
@pytest.mark.parametrize("paged", [False, True])
def test_decode_v7_matches_v2_bitwise(paged, causal, sq, splits, monkeypatch):
    """Version 7 (three K/V stages per warp at MT = 2) walks each warp's tiles in version 2's
    order, so its o and lse equal version 2's bit for bit; the split count is forced to 1 and 4
    so that warps walk 1 to 63 tiles (lengths 1, 7, 113, 1000, 4000: the pipeline's prologue
    with fewer tiles than stages, tails, and long chains), G = 32 (MT = 2) with Sq = 1 and a
    causal Sq = 2, contiguous and paged (page 16), NaN-poisoned outputs; version 7's pass the
    float64 reference too."""
    if _cc() < 80:
        pytest.skip("the decode kernel needs compute capability 8.0")
    from cuflash import _decode

    cp = cupy()
    monkeypatch.setattr(_decode, "choose_splits", lambda *a, **kw: splits)
    rng = _rng("decode-v7", paged, causal, sq, splits)
    lens = np.array([1, 7, 113, 1000, 4000], np.int32)
    q, k, v, bt, kn, vn = random_kv_problem(rng, b=5, hkv=1, group=32, sq=sq, d=128, lens=lens,
                                            snew=0, page=16 if paged else None, dtype="float16")
    args = (to_gpu(q, "float16"), to_gpu(k, "float16"), to_gpu(v, "float16"), cp.asarray(lens))
    res = {}
    for version in (2, 7):
        _decode_version(monkeypatch, version)
        out = poisoned(q.shape, "float16"), poisoned((5, 32, sq), "float32")
        res[version] = cuflash.attention_with_kvcache(
            *args, block_table=None if bt is None else cp.asarray(bt), causal=causal,
            return_lse=True, out=out)
    cp.cuda.get_current_stream().synchronize()
    assert cp.array_equal(res[2][0].view(cp.uint16), res[7][0].view(cp.uint16))
    assert cp.array_equal(res[2][1].view(cp.uint32), res[7][1].view(cp.uint32))
    check_kvcache_result(to_host64(res[7][0]), to_host64(res[7][1]), q, k, v, lens,
                         block_table=bt, k_new=None, v_new=None, causal=causal, dtype="float16")


V8_CASES = [  # (group, Sq, D, paged, causal): G 1 / 4 / 32, Sq 1-3, MT = 1 and 2, D buckets
    (1, 1, 128, False, False), (4, 3, 128, True, True), (32, 1, 128, False, False),
    (32, 2, 128, True, True), (4, 1, 64, True, False), (4, 2, 256, False, False)]


@pytest.mark.parametrize("splits", [2, 3, 4, 8, 9, 16, 17, 256])
@pytest.mark.parametrize("group,sq,d,paged,causal", V8_CASES)
def test_decode_v8_matches_v6_bitwise(group, sq, d, paged, causal, splits, monkeypatch):
    """Version 8 is version 6's main kernel with combine version 3 (a warp a packed row) for
    2 to COMBINE3_SPLITS[dpad] splits (16; 8 at D = 256) and combine 2 above; combine 3 sums
    in version 2's CB = 1 order, so o and lse equal version 6's bit for bit at every forced
    split count (2 .. 256: on both sides of the switch), through attention_with_kvcache with
    lengths 0, 1, 113 and 4000 (splits with no key, a sequence with none), contiguous and paged
    (page 16), NaN-poisoned outputs; version 8's pass the float64 reference, and the test
    checks which combine ran."""
    if _cc() < 80:
        pytest.skip("the decode kernel needs compute capability 8.0")
    from cuflash import _decode

    cp = cupy()
    monkeypatch.setattr(_decode, "choose_splits", lambda *a, **kw: splits)
    ran = []
    real = _decode.combine_spec_for
    monkeypatch.setattr(_decode, "combine_spec_for",
                        lambda plan, cfg: ran.append((_decode.version_of(plan), cfg.comb_ver,
                                                      cfg.splits)) or real(plan, cfg))
    rng = _rng("decode-v8", group, sq, d, paged, causal, splits)
    lens = np.array([0, 1, 113, 4000], np.int32)
    q, k, v, bt, kn, vn = random_kv_problem(rng, b=4, hkv=2, group=group, sq=sq, d=d, lens=lens,
                                            snew=0, page=16 if paged else None, dtype="float16")
    args = (to_gpu(q, "float16"), to_gpu(k, "float16"), to_gpu(v, "float16"), cp.asarray(lens))
    res = {}
    for version in (6, 8):
        _decode_version(monkeypatch, version)
        out = poisoned(q.shape, "float16"), poisoned((4, 2 * group, sq), "float32")
        res[version] = cuflash.attention_with_kvcache(
            *args, block_table=None if bt is None else cp.asarray(bt), causal=causal,
            return_lse=True, out=out)
    cp.cuda.get_current_stream().synchronize()
    used = {ver: (cv, ns) for ver, cv, ns in ran}
    assert set(used) == {6, 8}, ran
    ns = used[8][1]
    assert used[6] == (2, ns)
    assert used[8][0] == (3 if ns <= _decode.COMBINE3_SPLITS[d] else 2), used
    assert ns == splits if splits < 256 else ns > 200   # 4000 keys: 250-251 tiles of 16
    assert cp.array_equal(res[6][0].view(cp.uint16), res[8][0].view(cp.uint16))
    assert cp.array_equal(res[6][1].view(cp.uint32), res[8][1].view(cp.uint32))
    check_kvcache_result(to_host64(res[8][0]), to_host64(res[8][1]), q, k, v, lens,
                         block_table=bt, k_new=None, v_new=None, causal=causal, dtype="float16")


def test_kvcache_paged_matches_contiguous_bitwise():
    """The same keys in a contiguous and in a paged (page 16) cache give identical results."""
    if _cc() < 80:
        pytest.skip("the decode kernel needs compute capability 8.0")
    cp = cupy()
    rng = _rng("paged-eq")
    b, hkv, g, d, page = 3, 8, 4, 128, 16
    lens = np.array([1, 777, 4096], np.int32)
    k, v, bt = make_cache(rng, b=b, hkv=hkv, d=d, lens=lens, snew=0, page=page, dtype="float16")
    kc = np.zeros((b, 4096, hkv, d))
    vc = np.zeros_like(kc)
    for i in range(b):
        k_i, v_i = reference.gather_kv_cache(k, v, int(lens[i]), i, bt)
        kc[i, :lens[i]], vc[i, :lens[i]] = k_i, v_i
    q = to_gpu(_rnd(rng, (b, 1, hkv * g, d), "float16"), "float16")
    o1 = cuflash.attention_with_kvcache(q, to_gpu(k, "float16"), to_gpu(v, "float16"),
                                        cp.asarray(lens), block_table=cp.asarray(bt))
    o2 = cuflash.attention_with_kvcache(q, to_gpu(kc, "float16"), to_gpu(vc, "float16"),
                                        cp.asarray(lens))
    assert cp.array_equal(o1.view(cp.uint16), o2.view(cp.uint16))


# ---------------------------------------------------------------------------------------------
# attention_varlen on the GPU (decode kernel family with per-sequence offsets)

from varlen_util import check_varlen_result, make_varlen  # noqa: E402


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("h,hkv,d,lens_q,lens_k", [
    (8, 8, 128, (1, 7, 113, 1000), (1, 7, 113, 1000)),
    (32, 8, 128, (1, 300, 5, 2000), (64, 300, 7, 2000)),     # Sq != Sk
    (4, 1, 64, (3, 0, 17), (3, 9, 0)),                        # no queries; no keys
    (16, 4, 256, (250, 1), (250, 4096)),
])
def test_varlen_gpu(h, hkv, d, lens_q, lens_k, dtype, causal):
    _skip(dtype)
    if _cc() < 80:
        pytest.skip("the decode kernel needs compute capability 8.0")
    cp = cupy()
    rng = _rng("varlen-gpu", h, hkv, d, lens_q, dtype, causal)
    q, k, v, cu_q, cu_k = make_varlen(rng, np.array(lens_q), np.array(lens_k), h, hkv, d, dtype)
    o, lse = poisoned((q.shape[0], h, d), dtype), poisoned((h, q.shape[0]), "float32")
    res = cuflash.attention_varlen(to_gpu(q, dtype), to_gpu(k, dtype), to_gpu(v, dtype),
                                   cp.asarray(cu_q), cp.asarray(cu_k), max(lens_q), max(lens_k),
                                   causal=causal, return_lse=True, out=(o, lse))
    assert res[0] is o and res[1] is lse
    cp.cuda.get_current_stream().synchronize()
    check_varlen_result(to_host64(o), to_host64(lse), q, k, v, cu_q, cu_k, causal=causal,
                        dtype=dtype)


@pytest.mark.parametrize("version", [2, 1, 4, 6, 8])
@pytest.mark.parametrize("h,hkv", [(8, 2), (32, 1)])   # MT = 1; MT = 2 (32 rows a block)
@pytest.mark.parametrize("sk", [64, 8192])       # one split; many splits (the combine)
@pytest.mark.parametrize("where", ["q-head3", "k-key200-inf", "v-key100-nan", "v-key100-inf"])
def test_decode_nonfinite(where, sk, h, hkv, version, monkeypatch):
    """NaN and inf reach exactly the rows (and columns) the float64 reference puts them in."""
    if _cc() < 80:
        pytest.skip("the decode kernel needs compute capability 8.0")
    _decode_version(monkeypatch, version)
    rng = _rng("decode-nonfinite", where, sk, h, hkv, version)
    b, d = 1, 128
    q, k, v = (_rnd(rng, s, "float16") for s in ((b, h, 1, d), (b, hkv, sk, d), (b, hkv, sk, d)))
    if where == "q-head3":
        q[0, 3, 0, :] = np.nan
    elif where == "k-key200-inf":
        k[0, 0, min(200, sk - 1), 7] = np.inf
    else:
        v[0, hkv - 1, min(100, sk - 1), 5] = np.nan if where.endswith("nan") else np.inf
    o, lse = poisoned((b, h, 1, d), "float16"), poisoned((b, h, 1), "float32")
    cuflash.attention(*(to_gpu(x, "float16") for x in (q, k, v)), return_lse=True,
                      out=(o, lse), kernel="decode")
    cupy().cuda.get_current_stream().synchronize()
    oh = to_host64(o)
    rule = reference.pass_threshold(q, k, v, dtype="float16")
    assert np.array_equal(np.isnan(oh), np.isnan(rule.o_ref)), "NaN positions differ"
    verdict = rule.judge(oh)
    assert verdict.passed, "; ".join(verdict.reasons)


# ---------------------------------------------------------------------------------------------
# attention_varlen on the dense mma.sync forward (kernel="tensorcore": cuflash_fwd_mma_varlen)

def _varlen_kernel(kernel):
    """(attention_varlen kernel, _varlen.VARLEN_HOPPER_GROUP) of a test's kernel name:
    "hopper-gN" is the Hopper twin with blocks walking N slots of their sequence."""
    if kernel.startswith("hopper-g"):
        return "hopper", int(kernel[len("hopper-g"):])
    return kernel, 1


def _dense_varlen_skip(dtype, kernel="tensorcore", d=128):
    kernel = _varlen_kernel(kernel)[0]
    _skip(dtype)
    if _cc() < 80:
        pytest.skip("the mma.sync kernel needs compute capability 8.0")
    if kernel == "hopper" and _cc() != 90:
        pytest.skip("the Hopper kernel runs on compute capability 9.0")
    if kernel == "hopper" and d < 64:
        pytest.skip("the Hopper kernel takes head dims from 64")


# hopper-g2, -g3: the Hopper twin persistent over 2, 3 consecutive slots of a sequence
# (VARLEN_HOPPER_GROUP; -g3 leaves partial groups at the sequences' ends).
DENSE_VARLEN_KERNELS = ["tensorcore", "hopper", "hopper-g2", "hopper-g3"]


def _dense_varlen_call(q, k, v, cu_q, cu_k, lens_q, lens_k, dtype, causal, kernel="tensorcore",
                       o=None, lse=None):
    from cuflash import _varlen

    cp = cupy()
    kernel, group = _varlen_kernel(kernel)
    h = q.shape[1]
    gq, gk, gv = (x if isinstance(x, cp.ndarray) else to_gpu(x, dtype) for x in (q, k, v))
    o = poisoned((gq.shape[0], h, gv.shape[2]), dtype) if o is None else o
    lse = poisoned((h, gq.shape[0]), "float32") if lse is None else lse
    args = (gq, gk, gv, cp.asarray(cu_q), cp.asarray(cu_k), max(1, max(lens_q)),
            max(1, max(lens_k)))
    label = cuflash.varlen_dispatch_info(*args, causal=causal, kernel=kernel)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_varlen, "VARLEN_HOPPER_GROUP", group)
        res = cuflash.attention_varlen(*args, causal=causal, return_lse=True, out=(o, lse),
                                       kernel=kernel)
    assert res[0] is o and res[1] is lse
    cp.cuda.get_current_stream().synchronize()
    return o, lse, label


@pytest.mark.parametrize("kernel", DENSE_VARLEN_KERNELS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("h,hkv,d,lens_q,lens_k", [
    (8, 8, 128, (1, 7, 113, 1000), (1, 7, 113, 1000)),        # tails; > 2 tiles of 128 rows
    (32, 8, 128, (1, 300, 5, 2000), (64, 300, 7, 2000)),      # Sq != Sk; GQA
    (4, 1, 64, (3, 0, 17, 1), (3, 9, 0, 1)),                  # no queries; no keys; MQA
    (16, 4, 256, (250, 1), (250, 4096)),
    (6, 2, 96, (129, 64, 65), (40, 700, 65)),                 # Sq > Sk (rows that see no key)
    (2, 2, 32, (1000, 1, 33), (1, 1000, 33)),                 # D = 32 in the 64 bucket
])
def test_varlen_dense(h, hkv, d, lens_q, lens_k, dtype, causal, kernel):
    """The dense varlen forwards against the float64 reference per sequence, NaN-poisoned o and
    lse; the label names the varlen twin."""
    _dense_varlen_skip(dtype, kernel, d)
    rng = _rng("varlen-dense", h, hkv, d, lens_q, dtype, causal, kernel)
    q, k, v, cu_q, cu_k = make_varlen(rng, np.array(lens_q), np.array(lens_k), h, hkv, d, dtype)
    o, lse, label = _dense_varlen_call(q, k, v, cu_q, cu_k, lens_q, lens_k, dtype, causal,
                                       kernel=kernel)
    assert label.startswith(f"varlen-{_varlen_kernel(kernel)[0]}<"), label
    check_varlen_result(to_host64(o), to_host64(lse), q, k, v, cu_q, cu_k, causal=causal,
                        dtype=dtype)


@pytest.mark.parametrize("kernel", DENSE_VARLEN_KERNELS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("where", ["v-nan", "v-inf", "k-inf", "q-nan"])
def test_varlen_dense_neighbours_nonfinite(where, causal, kernel):
    """NaN / inf in the rows just past a sequence's keys (the next sequence's first key, the rows
    past cu_seqlens[-1]) reach no other sequence: sequence 1's first key and the trailing rows
    hold the poison; sequences 0 and 2 must pass, the trailing o rows stay unwritten. (The
    Hopper twin's tensor maps load those rows into the last tiles: masked in the scores, and
    O rows made non-finite by P = 0 times a non-finite V are recomputed exactly.)"""
    dtype = "float16"
    _dense_varlen_skip(dtype, kernel)
    rng = _rng("varlen-dense-nonfinite", where, causal, kernel)
    h, hkv, d = 4, 2, 128
    lens_q, lens_k = (50, 70, 33), (45, 90, 40)     # short tiles: the poison sits in a tile tail
    q, k, v, cu_q, cu_k = make_varlen(rng, np.array(lens_q), np.array(lens_k), h, hkv, d, dtype)
    pad = 20   # rows of no sequence after the last one
    q = np.concatenate([q, _rnd(rng, (pad, h, d), dtype)])
    k = np.concatenate([k, _rnd(rng, (pad, hkv, d), dtype)])
    v = np.concatenate([v, _rnd(rng, (pad, hkv, d), dtype)])
    bad = np.nan if where.endswith("nan") else np.inf
    x = {"v": v, "k": k, "q": q}[where[0]]
    first = int((cu_q if where[0] == "q" else cu_k)[1])
    x[first, :, 3] = bad                 # sequence 1's first row
    x[-pad:, :, :] = bad                 # every row past cu_seqlens[-1]
    o, lse, _ = _dense_varlen_call(q, k, v, cu_q, cu_k, lens_q, lens_k, dtype, causal,
                                   kernel=kernel)
    oh, lh = to_host64(o), to_host64(lse)
    check_varlen_result(oh, lh, q, k, v, cu_q, cu_k, causal=causal, dtype=dtype, skip=(1,))
    assert np.isnan(oh[-pad:]).all() and np.isnan(lh[:, -pad:]).all(), \
        "rows of no sequence were written"


@pytest.mark.parametrize("kernel", DENSE_VARLEN_KERNELS)
def test_varlen_dense_strided_views_and_lse_layout(kernel):
    """Packed q, k, v as views of wider buffers (a head slice of a fused qkv, padded rows), o and
    lse with padded strides: every sequence passes and the padding is untouched."""
    dtype = "bfloat16"
    _dense_varlen_skip(dtype, kernel)
    cp = cupy()
    rng = _rng("varlen-dense-strided")
    h, hkv, d = 8, 2, 64
    lens_q, lens_k = (1, 200, 7, 513), (9, 200, 300, 513)
    q, k, v, cu_q, cu_k = make_varlen(rng, np.array(lens_q), np.array(lens_k), h, hkv, d, dtype)
    tq, tk = q.shape[0], k.shape[0]
    qkv = to_gpu(np.concatenate([q, _rnd(rng, (tq, 3, d), dtype)], axis=1), dtype)  # (tq, h+3, d)
    kv = to_gpu(np.concatenate([k, v], axis=1), dtype)                             # (tk, 2hkv, d)
    gq, gk, gv = qkv[:, :h], kv[:, :hkv], kv[:, hkv:]
    o_full = poisoned((tq, h + 1, d), dtype)
    lse_full = poisoned((h, tq + 3), "float32")
    o, lse, _ = _dense_varlen_call(gq, gk, gv, cu_q, cu_k, lens_q, lens_k, dtype, True,
                                   kernel=kernel, o=o_full[:, 1:], lse=lse_full[:, :tq])
    check_varlen_result(to_host64(o), to_host64(lse), q, k, v, cu_q, cu_k, causal=True,
                        dtype=dtype)
    assert np.isnan(to_host64(o_full[:, 0])).all() and np.isnan(to_host64(lse_full[:, tq:])).all()


@pytest.mark.parametrize("kernel", DENSE_VARLEN_KERNELS)
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_dense_bits_equal_dense_attention(causal, kernel):
    """Each sequence's o and lse bit for bit what `attention(kernel=...)` gives on that sequence
    alone with the same tiles (the same kernel body on the segment view)."""
    from cuflash import _dispatch

    dtype = "float16"
    _dense_varlen_skip(dtype, kernel)
    cp = cupy()
    rng = _rng("varlen-dense-bits", causal, kernel)
    h, hkv, d = 8, 4, 128
    lens_q, lens_k = (300, 1, 129), (300, 77, 1000)
    q, k, v, cu_q, cu_k = make_varlen(rng, np.array(lens_q), np.array(lens_k), h, hkv, d, dtype)
    o, lse, label = _dense_varlen_call(q, k, v, cu_q, cu_k, lens_q, lens_k, dtype, causal,
                                       kernel=kernel)
    kernel = _varlen_kernel(kernel)[0]
    for s in range(len(lens_q)):
        q0, q1, k0, k1 = cu_q[s], cu_q[s + 1], cu_k[s], cu_k[s + 1]
        qs, ks, vs = (to_gpu(np.ascontiguousarray(x.transpose(1, 0, 2))[None], dtype)
                      for x in (q[q0:q1], k[k0:k1], v[k0:k1]))
        if kernel == "hopper":
            # the tiles the twin took (chosen for max_seqlen), not those of this sequence alone
            plan = _dispatch.varlen_hopper_plan(dtype, d, causal, max(lens_q), max(lens_k))
            assert label == plan.label
            dense = _dispatch.hopper_plan(dtype, d, causal, max(lens_k), sq=max(lens_q))
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(_dispatch, "hopper_plan", lambda *a, **kw: dense)
                o1, l1 = cuflash.attention(qs, ks, vs, causal=causal, return_lse=True,
                                           kernel="hopper")
        else:
            o1, l1 = cuflash.attention(qs, ks, vs, causal=causal, return_lse=True,
                                       kernel="tensorcore")
        assert cp.array_equal(cp.ascontiguousarray(o1[0].transpose(1, 0, 2)).view(cp.uint16),
                              cp.ascontiguousarray(o[q0:q1]).view(cp.uint16)), \
            f"sequence {s}: o bits differ"
        assert cp.array_equal(l1[0], lse[:, q0:q1]), f"sequence {s}: lse differs"


@pytest.mark.parametrize("kernel", ["tensorcore", "hopper"])
def test_varlen_auto_dispatch(monkeypatch, kernel):
    """kernel="auto": prefill-like calls take the dense twin when VARLEN_DENSE_AUTO is on (the
    Hopper one with VARLEN_HOPPER_AUTO; the same bits as naming it), decode-like ones stay on
    the decode family."""
    from cuflash import _varlen

    dtype = "float16"
    _dense_varlen_skip(dtype, kernel)
    cp = cupy()
    rng = _rng("varlen-auto", kernel)
    h, hkv, d = 8, 2, 128
    monkeypatch.setattr(_varlen, "VARLEN_HOPPER_AUTO", kernel == "hopper")
    for lens_q, lens_k, dense in (((100, 3), (100, 50), True), ((1, 1, 1), (500, 7, 30), False)):
        q, k, v, cu_q, cu_k = make_varlen(rng, np.array(lens_q), np.array(lens_k), h, hkv, d,
                                          dtype)
        for flag in (False, True):
            monkeypatch.setattr(_varlen, "VARLEN_DENSE_AUTO", flag)
            o, lse, label = _dense_varlen_call(q, k, v, cu_q, cu_k, lens_q, lens_k, dtype, True,
                                               kernel="auto")
            assert label.startswith(f"varlen-{kernel}<" if flag and dense else "decode<"), label
            check_varlen_result(to_host64(o), to_host64(lse), q, k, v, cu_q, cu_k, causal=True,
                                dtype=dtype)
            if flag and dense:
                o2, lse2, _ = _dense_varlen_call(q, k, v, cu_q, cu_k, lens_q, lens_k, dtype, True,
                                                 kernel=kernel)
                assert cp.array_equal(o.view(cp.uint16), o2.view(cp.uint16))
                assert cp.array_equal(lse, lse2)
