"""GPU tests of workspace= on the decode path (issue 14) and of CUDA-graph capture of a decode
step: a caller's workspace poisoned with NaN gives the same bits as the call without one (and
passes the float64 reference), nothing is allocated with out= and workspace=, and captured
graphs replayed on fresh inputs written into the captured buffers are right. Fresh random inputs
every run (the seed is in the test ids' rng key and printed on failure); skipped without a GPU.
"""
import math

import numpy as np
import pytest

import cuflash
from cuflash import reference

from gpu_util import check_against_reference, cupy, poisoned, to_gpu, to_host64
from kvcache_util import (check_appended, check_kvcache_result, make_cache,
                          random_kv_problem)
from varlen_util import check_varlen_result, make_varlen

pytestmark = pytest.mark.gpu

SEED = np.random.SeedSequence().entropy  # fresh inputs every run


def _rng(*key):
    return np.random.default_rng([SEED % 2**32, *[hash(str(x)) % 2**32 for x in key]])


def _need_decode(dtype="float16"):
    from gpu_util import bf16_dtype

    if int(cupy().cuda.Device().compute_capability) < 80:
        pytest.skip("the decode kernel needs compute capability 8.0")
    if dtype == "bfloat16" and bf16_dtype() is None:
        pytest.skip("bfloat16 on the GPU needs ml_dtypes (CuPy's bfloat16 dtype)")


def _rnd(rng, shape, dtype):
    return reference.round_to(rng.standard_normal(shape), dtype)


def _poisoned_ws(nbytes):
    """A workspace of `nbytes` with every byte 0xFF: NaN as float32, -1 as int32."""
    cp = cupy()
    ws = cp.empty(max(nbytes, 1), dtype=cp.uint8)
    ws.fill(0xFF)
    return ws


def _bits(x):
    cp = cupy()
    return x.view(cp.uint8) if x.dtype.itemsize == 1 else x.view(
        {2: cp.uint16, 4: cp.uint32}[x.dtype.itemsize])


def _same_bits(a, b, what):
    assert bool(cupy().array_equal(_bits(a), _bits(b))), f"{what}: results differ in bits"


def _CountMallocs():
    """A CuPy memory hook counting every pool request (a cached block or a new one) made inside
    its ``with`` block, in this thread."""
    cp = cupy()

    class Hook(cp.cuda.MemoryHook):
        name = "cuflash-count-mallocs"

        def __init__(self):
            self.n = 0
            self.sizes = []

        def malloc_preprocess(self, device_id, size, mem_size):
            self.n += 1
            self.sizes.append(size)

    return Hook()


def _write(dst, x64, dtype):
    """Write float64 values (representable in `dtype`) into the GPU buffer `dst`, bit for bit."""
    _bits(dst)[...] = _bits(to_gpu(x64, dtype))


# ---------------------------------------------------------------------------------------------
# A poisoned workspace gives the bits of the call without one

DENSE_CASES = [  # (b, h, hkv, sq, sk, d): every one splits the keys on an 80+ SM GPU
    (1, 32, 8, 1, 20000, 128),
    (2, 16, 4, 3, 8192, 64),       # Sq = 3 (12 packed rows), padded bucket
    (1, 8, 1, 1, 1000, 256),       # MQA, tail length
    (1, 4, 4, 7, 4113, 96),        # plain multi-head, padded head dim, tail keys
]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("b,h,hkv,sq,sk,d", DENSE_CASES)
def test_attention_decode_workspace(b, h, hkv, sq, sk, d, dtype, causal):
    _need_decode(dtype)
    cp = cupy()
    rng = _rng("ws-dense", b, h, hkv, sq, sk, d, dtype, causal)
    q, k, v = (_rnd(rng, s, dtype) for s in ((b, h, sq, d), (b, hkv, sk, d), (b, hkv, sk, d)))
    qg = to_gpu(q, dtype)
    # K and V through transposed views of (B, Sk, Hkv, D) buffers (a cache's layout)
    kg, vg = (to_gpu(np.ascontiguousarray(x.transpose(0, 2, 1, 3)), dtype).transpose(0, 2, 1, 3)
              for x in (k, v))
    o, lse = poisoned((b, h, sq, d), dtype), poisoned((b, h, sq), "float32")
    size = cuflash.attention_workspace_size(qg, kg, vg, causal=causal, return_lse=True,
                                            out=(o, lse), kernel="decode")
    assert size > 0, "this case should split the keys (the path the workspace is for)"
    assert size == cuflash.attention_workspace_size(qg, kg, vg, causal=causal, return_lse=True,
                                                    kernel="decode")
    ws = _poisoned_ws(size)
    res = cuflash.attention(qg, kg, vg, causal=causal, return_lse=True, out=(o, lse),
                            kernel="decode", workspace=ws)
    assert res[0] is o and res[1] is lse
    o2, lse2 = cuflash.attention(qg, kg, vg, causal=causal, return_lse=True, kernel="decode")
    cp.cuda.get_current_stream().synchronize()
    _same_bits(o, o2, "o with and without workspace")
    _same_bits(lse, lse2, "lse with and without workspace")
    check_against_reference(o, lse, q, k, v, causal=causal, scale=1 / math.sqrt(d), dtype=dtype)
    # a larger workspace, re-poisoned, at an offset of 256 bytes: the same bits again
    o3 = poisoned((b, h, sq, d), dtype)
    big = _poisoned_ws(cuflash.attention_workspace_size(qg, kg, vg, causal=causal, out=o3,
                                                        kernel="decode") + 256)
    cuflash.attention(qg, kg, vg, causal=causal, out=o3, kernel="decode", workspace=big[256:])
    cp.cuda.get_current_stream().synchronize()
    _same_bits(o3, o2, "o with a workspace at an offset")


KV_CASES = [  # (page or None, snew, lens or an int, group)
    (None, 0, (1, 7000, 113), 4),
    (16, 1, (0, 15, 9000), 8),          # an append crossing a page, an empty cache
    (32, 3, 6000, 4),                   # an int cache_seqlens with an append
    (None, 2, 5000, 1),
    (256, 0, 8191, 32),                 # an int without append: no device lengths at all
]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("page,snew,lens,group", KV_CASES)
def test_kvcache_workspace(page, snew, lens, group, causal):
    dtype = "float16"
    _need_decode(dtype)
    cp = cupy()
    rng = _rng("ws-kv", page, snew, lens, group, causal)
    b = 3 if isinstance(lens, int) else len(lens)
    lens_h = np.full(b, lens, np.int32) if isinstance(lens, int) else np.array(lens, np.int32)
    hkv, d, sq = 2, 128, 2
    q, k, v, bt, kn, vn = random_kv_problem(rng, b=b, hkv=hkv, group=group, sq=sq, d=d,
                                            lens=lens_h, snew=snew, page=page, dtype=dtype)
    kg, vg = to_gpu(k, dtype), to_gpu(v, dtype)
    args = (to_gpu(q, dtype), kg, vg, lens if isinstance(lens, int) else cp.asarray(lens_h))
    kw = dict(block_table=None if bt is None else cp.asarray(bt),
              k_new=None if kn is None else to_gpu(kn, dtype),
              v_new=None if vn is None else to_gpu(vn, dtype), causal=causal)
    size = cuflash.attention_with_kvcache_workspace_size(*args, **kw)
    assert size > 0
    o, lse = poisoned((b, sq, hkv * group, d), dtype), poisoned((b, hkv * group, sq), "float32")
    res = cuflash.attention_with_kvcache(*args, **kw, return_lse=True, out=(o, lse),
                                         workspace=_poisoned_ws(size))
    assert res[0] is o and res[1] is lse
    # the append is idempotent (same keys, same places): the call without a workspace repeats it
    o2, lse2 = cuflash.attention_with_kvcache(*args, **kw, return_lse=True)
    cp.cuda.get_current_stream().synchronize()
    _same_bits(o, o2, "o with and without workspace")
    _same_bits(lse, lse2, "lse with and without workspace")
    check_kvcache_result(to_host64(o), to_host64(lse), q, k, v, lens_h, block_table=bt,
                         k_new=kn, v_new=vn, causal=causal, dtype=dtype)
    if snew:
        check_appended(to_host64(kg), to_host64(vg), lens_h, kn, vn, block_table=bt)


def test_kvcache_int_zero_lengths_is_empty():
    """cache_seqlens=0 and nothing appended: no launch, o = 0 and lse = -inf everywhere."""
    _need_decode()
    cp = cupy()
    kc = to_gpu(_rnd(_rng("kv0"), (2, 64, 2, 64), "float16"), "float16")
    q = to_gpu(_rnd(_rng("kv0q"), (2, 1, 4, 64), "float16"), "float16")
    assert cuflash.attention_with_kvcache_workspace_size(q, kc, kc, 0) == 0
    o, lse = poisoned((2, 1, 4, 64), "float16"), poisoned((2, 4, 1), "float32")
    cuflash.attention_with_kvcache(q, kc, kc, 0, return_lse=True, out=(o, lse))
    cp.cuda.get_current_stream().synchronize()
    assert bool(cp.all(o == 0)) and bool(cp.all(cp.isneginf(lse)))


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_workspace(causal):
    dtype = "bfloat16"
    _need_decode(dtype)
    cp = cupy()
    rng = _rng("ws-varlen", causal)
    h, hkv, d = 16, 4, 128
    lens_q, lens_k = np.array([1, 3, 2, 0]), np.array([9000, 1, 300, 7])
    q, k, v, cu_q, cu_k = make_varlen(rng, lens_q, lens_k, h, hkv, d, dtype)
    args = (to_gpu(q, dtype), to_gpu(k, dtype), to_gpu(v, dtype), cp.asarray(cu_q),
            cp.asarray(cu_k), 3, 9000)
    size = cuflash.attention_varlen_workspace_size(*args, causal=causal)
    assert size > 0
    o, lse = poisoned((q.shape[0], h, d), dtype), poisoned((h, q.shape[0]), "float32")
    cuflash.attention_varlen(*args, causal=causal, return_lse=True, out=(o, lse),
                             workspace=_poisoned_ws(size))
    o2, lse2 = cuflash.attention_varlen(*args, causal=causal, return_lse=True)
    cp.cuda.get_current_stream().synchronize()
    _same_bits(o, o2, "o with and without workspace")
    _same_bits(lse, lse2, "lse with and without workspace")
    check_varlen_result(to_host64(o), to_host64(lse), q, k, v, cu_q, cu_k, causal=causal,
                        dtype=dtype)


# ---------------------------------------------------------------------------------------------
# Nothing allocated with out= and workspace=; CUDA graphs

def test_no_allocation_with_workspace_and_out():
    _need_decode()
    cp = cupy()
    rng = _rng("noalloc")
    dt = "float16"
    # attention (decode, split)
    q, k, v = (to_gpu(_rnd(rng, s, dt), dt) for s in ((1, 32, 1, 128), (1, 8, 9000, 128),
                                                        (1, 8, 9000, 128)))
    o, lse = poisoned((1, 32, 1, 128), dt), poisoned((1, 32, 1), "float32")
    ws = cp.empty(cuflash.attention_workspace_size(q, k, v, return_lse=True, out=(o, lse)),
                  cp.uint8)
    # kvcache (paged, append) and varlen
    kc, vc, bt = make_cache(rng, b=2, hkv=8, d=128, lens=np.array([3000, 17]), snew=1, page=16,
                            dtype=dt)
    kv = (to_gpu(_rnd(rng, (2, 1, 32, 128), dt), dt), to_gpu(kc, dt), to_gpu(vc, dt),
          cp.asarray(np.array([3000, 17], np.int32)))
    kvkw = dict(block_table=cp.asarray(bt), k_new=to_gpu(_rnd(rng, (2, 1, 8, 128), dt), dt),
                v_new=to_gpu(_rnd(rng, (2, 1, 8, 128), dt), dt))
    o_kv = poisoned((2, 1, 32, 128), dt)
    ws_kv = cp.empty(cuflash.attention_with_kvcache_workspace_size(*kv, **kvkw), cp.uint8)
    qv, kvv, vv, cu_q, cu_k = make_varlen(rng, np.array([2, 1]), np.array([5000, 40]), 8, 2,
                                          64, dt)
    va = (to_gpu(qv, dt), to_gpu(kvv, dt), to_gpu(vv, dt), cp.asarray(cu_q), cp.asarray(cu_k),
          2, 5000)
    o_v = poisoned((3, 8, 64), dt)
    ws_v = cp.empty(cuflash.attention_varlen_workspace_size(*va), cp.uint8)
    assert min(ws.nbytes, ws_kv.nbytes, ws_v.nbytes) > 0

    def calls():
        cuflash.attention(q, k, v, return_lse=True, out=(o, lse), workspace=ws)
        cuflash.attention_with_kvcache(*kv, **kvkw, out=o_kv, workspace=ws_kv)
        cuflash.attention_varlen(*va, out=o_v, workspace=ws_v)

    calls()  # compile and load every kernel first
    cp.cuda.Device().synchronize()
    pool = cp.get_default_memory_pool()
    before = pool.used_bytes()
    hook = _CountMallocs()
    with hook:
        calls()
    assert hook.n == 0, f"{hook.n} pool allocations ({hook.sizes} bytes) with out= and workspace="
    assert pool.used_bytes() == before
    # and without workspace= the partials are allocated (what the docstrings say)
    hook = _CountMallocs()
    with hook:
        cuflash.attention(q, k, v, return_lse=True, out=(o, lse))
    assert hook.n >= 1
    cp.cuda.Device().synchronize()


def _capture(stream, fn):
    """(graph, pool requests during capture, used-bytes change) of `fn` captured on `stream`."""
    cp = cupy()
    pool = cp.get_default_memory_pool()
    cp.cuda.Device().synchronize()
    before = pool.used_bytes()
    hook = _CountMallocs()
    with stream, hook:
        stream.begin_capture()
        fn()
        graph = stream.end_capture()
    return graph, hook.n, pool.used_bytes() - before


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_graph_capture_of_a_decode_step(dtype):
    """attention (grouped-query decode, split keys) captured on a non-default stream with out=
    and workspace=, replayed on fresh q, k, v written into the captured buffers."""
    _need_decode(dtype)
    cp = cupy()
    rng = _rng("graph-decode", dtype)
    b, h, hkv, sk, d = 2, 32, 8, 10000, 128
    shapes = ((b, h, 1, d), (b, hkv, sk, d), (b, hkv, sk, d))
    q, k, v = (_rnd(rng, s, dtype) for s in shapes)
    qg = to_gpu(q, dtype)
    kbuf, vbuf = (to_gpu(np.ascontiguousarray(x.transpose(0, 2, 1, 3)), dtype) for x in (k, v))
    kg, vg = kbuf.transpose(0, 2, 1, 3), vbuf.transpose(0, 2, 1, 3)
    o, lse = poisoned((b, h, 1, d), dtype), poisoned((b, h, 1), "float32")
    ws = cp.empty(cuflash.attention_workspace_size(qg, kg, vg, return_lse=True, out=(o, lse)),
                  cp.uint8)
    assert ws.nbytes > 0
    s = cp.cuda.Stream(non_blocking=True)

    def step():
        cuflash.attention(qg, kg, vg, return_lse=True, out=(o, lse), workspace=ws, stream=s)

    step()  # compile and load the kernels outside the capture
    s.synchronize()
    graph, n_alloc, grown = _capture(s, step)
    assert n_alloc == 0 and grown == 0, "the captured call allocated"
    for trial in range(2):
        q, k, v = (_rnd(rng, sh, dtype) for sh in shapes)
        _write(qg, q, dtype)
        _write(kbuf, np.ascontiguousarray(k.transpose(0, 2, 1, 3)), dtype)
        _write(vbuf, np.ascontiguousarray(v.transpose(0, 2, 1, 3)), dtype)
        o.view(cp.uint8).fill(0xFF)
        lse.view(cp.uint8).fill(0xFF)
        ws.fill(0xFF)
        cp.cuda.Device().synchronize()
        graph.launch(stream=s)
        s.synchronize()
        check_against_reference(o, lse, q, k, v, causal=False, scale=1 / math.sqrt(d),
                                dtype=dtype)


@pytest.mark.parametrize("page", [None, 16])
@pytest.mark.parametrize("causal", [False, True])
def test_graph_capture_of_kvcache_append_and_attend(page, causal):
    """attention_with_kvcache (append one or more keys, then attend) captured on a non-default
    stream, replayed as decoding steps: fresh q, k_new, v_new and advanced lengths written into
    the captured buffers before each replay."""
    dtype = "float16"
    _need_decode(dtype)
    cp = cupy()
    rng = _rng("graph-kv", page, causal)
    b, hkv, g, d, sq, snew, steps = 3, 2, 4, 128, 2, 2, 3
    lens = np.array([0, 700, 6000], np.int32)
    k, v, bt = make_cache(rng, b=b, hkv=hkv, d=d, lens=lens, snew=snew * (steps + 1), page=page,
                          dtype=dtype)
    kg, vg = to_gpu(k, dtype), to_gpu(v, dtype)
    btg = None if bt is None else cp.asarray(bt)
    qs, ns = (b, sq, hkv * g, d), (b, snew, hkv, d)
    qg = to_gpu(_rnd(rng, qs, dtype), dtype)
    kn, vn = (to_gpu(_rnd(rng, ns, dtype), dtype) for _ in range(2))
    lens_g = cp.asarray(lens)
    o, lse = poisoned(qs, dtype), poisoned((b, hkv * g, sq), "float32")
    kw = dict(block_table=btg, k_new=kn, v_new=vn, causal=causal)
    ws = cp.empty(cuflash.attention_with_kvcache_workspace_size(qg, kg, vg, lens_g, **kw),
                  cp.uint8)
    s = cp.cuda.Stream(non_blocking=True)

    def step():
        cuflash.attention_with_kvcache(qg, kg, vg, lens_g, **kw, return_lse=True, out=(o, lse),
                                       workspace=ws, stream=s)

    step()  # compile and load outside the capture (it appends at `lens`; replays overwrite)
    s.synchronize()
    graph, n_alloc, grown = _capture(s, step)
    assert n_alloc == 0 and grown == 0, "the captured call allocated"
    for t in range(steps):
        q = _rnd(rng, qs, dtype)
        k_new, v_new = (_rnd(rng, ns, dtype) for _ in range(2))
        _write(qg, q, dtype)
        _write(kn, k_new, dtype)
        _write(vn, v_new, dtype)
        lens_g[...] = cp.asarray(lens)
        o.view(cp.uint8).fill(0xFF)
        lse.view(cp.uint8).fill(0xFF)
        ws.fill(0xFF)
        cp.cuda.Device().synchronize()
        kh, vh = to_host64(kg), to_host64(vg)   # the cache before this step's append
        graph.launch(stream=s)
        s.synchronize()
        check_kvcache_result(to_host64(o), to_host64(lse), q, kh, vh, lens, block_table=bt,
                             k_new=k_new, v_new=v_new, causal=causal, dtype=dtype)
        check_appended(to_host64(kg), to_host64(vg), lens, k_new, v_new, block_table=bt,
                       what=f"step {t}")
        np.testing.assert_array_equal(cp.asnumpy(lens_g), lens)  # not advanced (as documented)
        lens = lens + snew


# ---------------------------------------------------------------------------------------------
# Errors, before any launch

def test_workspace_errors_on_gpu():
    _need_decode()
    cp = cupy()
    rng = _rng("ws-errors")
    dt = "float16"
    q, k = (to_gpu(_rnd(rng, s, dt), dt) for s in ((1, 8, 1, 64), (1, 2, 9000, 64)))
    size = cuflash.attention_workspace_size(q, k, k)
    assert size > 0
    o = poisoned((1, 8, 1, 64), dt)
    with pytest.raises(ValueError, match=f"workspace has {size - 4} bytes; this call needs "
                                         f"{size} \\(cuflash.attention_workspace_size\\)"):
        cuflash.attention(q, k, k, out=o, workspace=cp.empty(size - 4, cp.uint8))
    ws = cp.empty(size + 256, cp.uint8)
    with pytest.raises(ValueError, match="256-byte boundary"):
        cuflash.attention(q, k, k, out=o, workspace=ws[16:])
    with pytest.raises(ValueError, match="C-contiguous"):
        cuflash.attention(q, k, k, out=o, workspace=cp.empty(2 * size, cp.uint8)[::2])
    with pytest.raises(ValueError, match="workspace is on the CPU \\(NumPy\\) but the inputs are "
                                         "on GPU"):
        cuflash.attention(q, k, k, out=o, workspace=np.empty(size, np.uint8))
    cp.cuda.get_current_stream().synchronize()
    assert bool(cp.all(cp.isnan(o))), "an error was raised after a launch wrote out"
    # kvcache: the workspace is checked before the append
    kc, vc, _ = make_cache(rng, b=1, hkv=2, d=64, lens=np.array([9000]), snew=1, page=None,
                           dtype=dt)
    kcg, vcg = to_gpu(kc, dt), to_gpu(vc, dt)
    kn = to_gpu(_rnd(rng, (1, 1, 2, 64), dt), dt)
    args = (q.transpose(0, 2, 1, 3), kcg, vcg, cp.asarray(np.array([9000], np.int32)))
    need = cuflash.attention_with_kvcache_workspace_size(*args, k_new=kn, v_new=kn)
    with pytest.raises(ValueError, match="attention_with_kvcache_workspace_size"):
        cuflash.attention_with_kvcache(*args, k_new=kn, v_new=kn,
                                       workspace=cp.empty(need - 256, cp.uint8))
    cp.cuda.get_current_stream().synchronize()
    np.testing.assert_array_equal(to_host64(kcg), kc)   # nothing appended
    if cp.cuda.runtime.getDeviceCount() > 1:
        with cp.cuda.Device(1):
            other = cp.empty(size, cp.uint8)
        with pytest.raises(ValueError, match="workspace is on GPU 1"):
            cuflash.attention(q, k, k, out=o, workspace=other)
