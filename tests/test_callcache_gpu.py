"""GPU tests of the per-signature call cache (cuflash/_callcache.py) on both forward paths, the
dense kernels and the decode kernel (split-KV partials + combine): a hit on new buffers gives
bitwise the full path's result and passes the float64 reference; a changed signature misses; the
split partials of calls on two streams never share a pool block while their kernels may run;
torch tensors and the JAX callback take their records too. Fresh random inputs every run (the
seed is in pytest's header); outputs poisoned with NaN; skipped without a GPU."""
import numpy as np
import pytest

import cuflash
from cuflash import _callcache, _checks, _decode, reference

from gpu_util import bf16_dtype, check_against_reference, cupy, poisoned, to_gpu
from seeds import SEED, case_rng

pytestmark = pytest.mark.gpu


def _rng(*key):
    return case_rng(SEED, *key)


def _need(dtype):
    if dtype == "bfloat16" and bf16_dtype() is None:
        pytest.skip("bfloat16 on the GPU needs ml_dtypes (CuPy's bfloat16 dtype)")
    if int(cupy().cuda.Device().compute_capability) < 80:
        pytest.skip("the decode and tensor-core kernels need compute capability 8.0")


def _inputs(rng, qs, ks, dtype):
    q = reference.round_to(rng.standard_normal(qs), dtype)
    k = reference.round_to(rng.standard_normal(ks), dtype)
    v = reference.round_to(rng.standard_normal(ks), dtype)
    return q, k, v


def _bits(x):
    cp = cupy()
    return x.view({1: cp.uint8, 2: cp.uint16, 4: cp.uint32}[x.dtype.itemsize])


def _same_bits(a, b, what):
    assert bool(cupy().array_equal(_bits(a), _bits(b))), f"{what}: the hit's bits differ"


@pytest.fixture
def checks(monkeypatch):
    """Counts full-path calls (the checks run once per full-path call, never on a hit)."""
    n = {"checks": 0}
    real = _checks.check_attention

    def counting(*a, **kw):
        n["checks"] += 1
        return real(*a, **kw)

    monkeypatch.setattr(_checks, "check_attention", counting)
    return n


_CASES = [  # (q shape, k/v shape, causal, dtype, path kernel="auto" takes)
    ((1, 1, 16, 64), (1, 1, 16, 64), False, "float16", "decode"),     # issue 13's shape
    ((2, 3, 1, 64), (2, 3, 1000, 64), True, "float16", "decode"),     # Sq = 1, split keys
    ((2, 4, 7, 128), (2, 4, 113, 128), False, "bfloat16", "decode"),  # Sq = 7
    ((1, 8, 16, 64), (1, 2, 1000, 64), False, "float16", "decode"),   # grouped heads, split
    ((3, 4, 1, 128), (3, 1, 4096, 128), True, "bfloat16", "decode"),  # multi-query, split
    ((1, 2, 128, 64), (1, 2, 128, 64), True, "float16", "dense"),     # the dense S = 128 row
    ((2, 8, 113, 64), (2, 2, 1000, 64), True, "float16", "dense"),    # grouped heads, dense
    ((1, 2, 7, 64), (1, 2, 113, 64), True, "float16", "dense"),       # causal Sq > 1: dense
]


@pytest.mark.parametrize("return_lse", [False, True])
@pytest.mark.parametrize("with_out", [False, True, "o_only"])
@pytest.mark.parametrize("qs,ks,causal,dtype,path", _CASES)
def test_hit_is_bitwise_the_full_path_and_passes_the_reference(checks, qs, ks, causal, dtype,
                                                               path, with_out, return_lse):
    _need(dtype)
    cp = cupy()
    rng = _rng("hit", qs, ks, causal, dtype, with_out, return_lse)
    label = cuflash.dispatch_info(*(to_gpu(x, dtype) for x in _inputs(rng, qs, ks, dtype)),
                                  causal=causal)
    assert label.startswith("decode<") == (path == "decode"), label

    def outs():
        if not with_out:
            return None
        o = poisoned(qs, dtype)
        return (o, poisoned(qs[:-1], "float32")) if return_lse and with_out is True else o

    def split(res):
        return res if return_lse else (res, None)

    kw = dict(causal=causal, return_lse=return_lse)
    first = _inputs(rng, qs, ks, dtype)
    cuflash.attention(*(to_gpu(x, dtype) for x in first), out=outs(), **kw)   # recorded
    n = checks["checks"]
    q, k, v = _inputs(rng, qs, ks, dtype)                                     # new buffers
    qg, kg, vg = to_gpu(q, dtype), to_gpu(k, dtype), to_gpu(v, dtype)
    out = outs()
    o_hit, lse_hit = split(cuflash.attention(qg, kg, vg, out=out, **kw))
    assert checks["checks"] == n, "the repeated signature must be a hit"
    if with_out:
        assert o_hit is (out[0] if isinstance(out, tuple) else out)
    check_against_reference(o_hit, lse_hit, q, k, v, causal=causal, scale=None, dtype=dtype)
    # the same inputs again into other outputs (the Hopper kernel keeps the tensor maps of the
    # last inputs and writes the new output pointers in)
    o_again, lse_again = split(cuflash.attention(qg, kg, vg, out=outs(), **kw))
    assert checks["checks"] == n
    _same_bits(o_again, o_hit, "o, second hit")
    if return_lse:
        _same_bits(lse_again, lse_hit, "lse, second hit")
    cp.cuda.Stream.null.synchronize()
    _callcache.clear()
    o_full, lse_full = split(cuflash.attention(qg, kg, vg, out=outs(), **kw))
    assert checks["checks"] == n + 1
    assert o_full.shape == o_hit.shape and o_full.strides == o_hit.strides
    _same_bits(o_hit, o_full, "o")
    if return_lse:
        assert lse_full.shape == lse_hit.shape
        _same_bits(lse_hit, lse_full, "lse")


def test_changed_signatures_miss_and_stay_right(checks, monkeypatch):
    _need("float16")
    rng = _rng("miss")
    qs, ks = (2, 4, 1, 64), (2, 4, 1000, 64)
    base = dict(causal=True)

    def run(qs, ks, dtype="float16", transpose_k=False, **kw):
        q, k, v = _inputs(rng, qs, ks, dtype)
        qg, kg, vg = to_gpu(q, dtype), to_gpu(k, dtype), to_gpu(v, dtype)
        if transpose_k:   # the same values through a (B, S, H, D) buffer: other strides
            kg = to_gpu(np.ascontiguousarray(np.swapaxes(k, 1, 2)), dtype).swapaxes(1, 2)
        n = checks["checks"]
        o = cuflash.attention(qg, kg, vg, **kw)
        check_against_reference(o, None, q, k, v, causal=kw.get("causal", False), scale=None,
                                dtype=dtype)
        return checks["checks"] - n

    assert run(qs, ks, **base) == 1
    assert run(qs, ks, **base) == 0                     # the recorded signature: a hit
    assert run((2, 4, 2, 64), ks, **base) == 1          # Sq
    assert run(qs, (2, 4, 999, 64), **base) == 1        # Sk
    assert run(qs, ks, "bfloat16", **base) == 1 if bf16_dtype() is not None else True
    assert run(qs, ks, transpose_k=True, **base) == 1   # strides
    assert run(qs, ks, causal=False) == 1               # flag
    assert run(qs, ks, kernel="tensorcore", **base) == 1
    monkeypatch.setattr(_decode, "DECODE_MAX_SQ", 0)    # a swapped table: the dense kernels
    assert run(qs, ks, **base) == 1
    assert not cuflash.dispatch_info(*(to_gpu(x, "float16") for x in _inputs(rng, qs, ks,
                                                                             "float16")),
                                     causal=True).startswith("decode")


def test_split_partials_of_two_streams_never_share_a_pool_block(checks):
    """Decode hits with split keys on two streams, enqueued back to back without a sync: each
    call's partials are a pool block allocated on its own launch stream and freed right after
    the enqueue, so CuPy's pool may hand it only to later work of that stream. Were a block
    shared across the streams, one call's combine would read the other's partials (the calls
    share K and V and differ in q, so each kernel runs long enough to overlap the next)."""
    _need("float16")
    cp = cupy()
    rng = _rng("streams")
    _, k, v = _inputs(rng, (1, 8, 1, 128), (1, 8, 16384, 128), "float16")
    kg, vg = to_gpu(k, "float16"), to_gpu(v, "float16")
    qs = [reference.round_to(rng.standard_normal((1, 8, 1, 128)), "float16") for _ in range(8)]
    qg = [to_gpu(q, "float16") for q in qs]
    assert cuflash.attention_workspace_size(qg[0], kg, vg) > 0, "the case must split the keys"
    streams = [cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)]
    cp.cuda.Device().synchronize()
    for s in streams:
        cuflash.attention(qg[0], kg, vg, stream=s)
        s.synchronize()
    n = checks["checks"]
    res = [cuflash.attention(q, kg, vg, stream=streams[i % 2]) for i, q in enumerate(qg)]
    assert checks["checks"] == n, "every call after the first must be a hit"
    for s in streams:
        s.synchronize()
    for o, q in zip(res, qs):
        check_against_reference(o, None, q, k, v, causal=False, scale=None, dtype="float16")


def test_caller_workspace_hit_allocates_nothing(checks):
    _need("float16")
    cp = cupy()
    rng = _rng("workspace")
    qs, ks = (2, 4, 1, 128), (2, 4, 4096, 128)
    q, k, v = _inputs(rng, qs, ks, "float16")
    qg, kg, vg = (to_gpu(x, "float16") for x in (q, k, v))
    size = cuflash.attention_workspace_size(qg, kg, vg, return_lse=True)
    assert size > 0
    ws = cp.empty(size, dtype=cp.uint8)
    ws.fill(0xFF)
    o, lse = poisoned(qs, "float16"), poisoned(qs[:-1], "float32")
    cuflash.attention(*(to_gpu(x, "float16") for x in _inputs(rng, qs, ks, "float16")),
                      return_lse=True, out=(o, lse), workspace=ws)
    n = checks["checks"]
    o, lse = poisoned(qs, "float16"), poisoned(qs[:-1], "float32")

    class Count(cp.cuda.MemoryHook):
        name = "cuflash-callcache-count"
        n = 0

        def malloc_preprocess(self, device_id, size, mem_size):
            Count.n += 1

    with Count():
        res = cuflash.attention(qg, kg, vg, return_lse=True, out=(o, lse), workspace=ws)
    assert checks["checks"] == n and Count.n == 0, "a hit with out= and workspace= allocates"
    assert res[0] is o and res[1] is lse
    check_against_reference(o, lse, q, k, v, causal=False, scale=None, dtype="float16")
    o2, lse2 = cuflash.attention(qg, kg, vg, return_lse=True)   # the pool's partials
    _same_bits(o, o2, "o (caller's workspace against the pool's)")
    _same_bits(lse, lse2, "lse")


@pytest.mark.parametrize("s", [16, 128])
def test_torch_tensors_hit(checks, s):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    _need("float16")
    rng = _rng("torch", s)
    qs = (1, 4, s, 64)
    ks = (1, 4, 1000, 64)

    def tensors():
        q, k, v = _inputs(rng, qs, ks, "float16")
        return (q, k, v), tuple(torch.tensor(x, dtype=torch.float16, device="cuda")
                                for x in (q, k, v))
    cuflash.attention(*tensors()[1])
    n = checks["checks"]
    (q, k, v), t = tensors()
    o = cuflash.attention(*t)
    assert checks["checks"] == n, "a repeated torch signature must be a hit"
    check_against_reference(o, None, q, k, v, causal=False, scale=None, dtype="float16")
    _callcache.clear()
    _same_bits(o, cuflash.attention(*t), "torch hit against the full path")
    # torch's current stream is not the launch stream: the full path (it orders the launch)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        n = checks["checks"]
        o = cuflash.attention(*t)
        assert checks["checks"] == n + 1
    torch.cuda.synchronize()
    check_against_reference(o, None, q, k, v, causal=False, scale=None, dtype="float16")


def test_jax_callback_decode_records():
    jax = pytest.importorskip("jax")
    if jax.default_backend() != "gpu":
        pytest.skip("JAX's default backend is not a GPU")
    _need("float16")
    import jax.numpy as jnp

    import cuflash.jax as cj

    rng = _rng("jax")
    f = jax.jit(lambda q, k, v: cj.attention(q, k, v, return_lse=True))
    # JAX layout (B, S, H, D): 8 query heads over 2 kv heads, Sq = 1 over 1000 keys (split)
    for _ in range(3):   # the first call records, the next two launch the record
        q = reference.round_to(rng.standard_normal((2, 1, 8, 64)), "float16")
        k = reference.round_to(rng.standard_normal((2, 1000, 2, 64)), "float16")
        v = reference.round_to(rng.standard_normal((2, 1000, 2, 64)), "float16")
        o, lse = f(*(jnp.asarray(x, dtype=jnp.float16) for x in (q, k, v)))
        qc, kc, vc = (np.moveaxis(x, 1, 2) for x in (q, k, v))   # (B, H, S, D)
        o_ref, lse_ref = reference.attention_ref(qc, kc, vc)
        rule = reference.pass_threshold(qc, kc, vc, dtype="float16", o_ref=o_ref)
        o64 = np.moveaxis(np.asarray(o, dtype=np.float64), 1, 2)
        assert not np.isnan(o64).any()
        verdict = rule.judge(o64)
        assert verdict.passed, "; ".join(verdict.reasons)
        lse64 = np.asarray(lse, dtype=np.float64)   # (B, Sq, H)
        assert np.allclose(np.moveaxis(lse64, 1, 2), lse_ref, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("qs,ks,causal,dtype,path", [_CASES[0], _CASES[1], _CASES[5]])
def test_hits_from_other_threads_streams_and_alternating_inputs(checks, qs, ks, causal, dtype,
                                                                 path):
    """The hit's shortcuts on the GPU: the owner thread's parameter block written in place and
    passed by address, another thread's block per call, no stream object without stream= (the
    current stream at each call), a raw stream handle, and inputs alternating between buffer
    sets (the Hopper kernel keeps each set's tensor maps). Every hit passes the float64
    reference and is bitwise the full path's result for its inputs."""
    import threading

    _need(dtype)
    cp = cupy()
    rng = _rng("shortcuts", qs, ks, causal, dtype)
    sets = [_inputs(rng, qs, ks, dtype) for _ in range(3)]
    gpu = [tuple(to_gpu(x, dtype) for x in s) for s in sets]
    # recorded on this thread, with out= as every call below (a call without out= is another
    # signature: the H200 run of 2026-12-02 counted that one miss)
    cuflash.attention(*gpu[0], causal=causal, out=poisoned(qs, dtype))
    n = checks["checks"]
    s1 = cp.cuda.Stream(non_blocking=True)
    results = []

    def call(i, how):
        o = poisoned(qs, dtype)
        cp.cuda.Device().synchronize()   # (s1 does not wait for the null stream's writes)
        if how == "stream-int":
            cuflash.attention(*gpu[i], causal=causal, out=o, stream=s1.ptr)
        elif how == "current":
            with s1:
                cuflash.attention(*gpu[i], causal=causal, out=o)
        else:
            cuflash.attention(*gpu[i], causal=causal, out=o)
        results.append((i, how, o))

    plan = [(1, "plain"), (0, "current"), (2, "stream-int"), (1, "plain"), (2, "plain"),
            (0, "stream-int")]
    for i, how in plan:
        call(i, how)
    t = threading.Thread(target=lambda: [call(i, "thread") for i in (2, 0, 1)])
    t.start()
    t.join()
    call(1, "plain")   # the owner again, after the other thread's calls
    cp.cuda.Device().synchronize()
    assert checks["checks"] == n, "every call must be a hit"
    for i, how, o in results:
        q, k, v = sets[i]
        check_against_reference(o, None, q, k, v, causal=causal, scale=None, dtype=dtype)
    full = []
    for g in gpu:   # each on the full path
        _callcache.clear()
        full.append(cuflash.attention(*g, causal=causal))
    assert checks["checks"] == n + 3
    cp.cuda.Device().synchronize()
    for i, how, o in results:
        _same_bits(o, full[i], f"input set {i}, {how}")


@pytest.mark.parametrize("fast", [False, True])
@pytest.mark.parametrize("qs,ks,causal,dtype,path", [_CASES[0], _CASES[1], _CASES[5], _CASES[6]])
def test_no_out_hits_return_fresh_arrays_on_the_current_device(checks, monkeypatch, fast, qs, ks,
                                                               causal, dtype, path):
    """Without out=, each hit (CUFLASH_FAST_EMPTY off and on) returns new owning arrays on the
    current device with the full path's shape, strides and dtype, never a kept result's memory,
    and bitwise the full path's values."""
    _need(dtype)
    cp = cupy()
    monkeypatch.setattr(_callcache, "FAST_EMPTY", fast)
    _callcache.clear()
    rng = _rng("fresh", qs, ks, causal, dtype, fast)
    q, k, v = (to_gpu(x, dtype) for x in _inputs(rng, qs, ks, dtype))
    o_full, lse_full = cuflash.attention(q, k, v, causal=causal, return_lse=True)
    n = checks["checks"]
    kept = []
    for _ in range(3):
        o, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
        assert checks["checks"] == n, "the repeated signature must be a hit"
        for a, b in ((o, o_full), (lse, lse_full)):
            assert type(a) is cp.ndarray and a.flags.owndata and a.base is None
            assert (a.shape, a.strides, a.dtype) == (b.shape, b.strides, b.dtype)
            assert a.device.id == cp.cuda.Device().id == b.device.id
            assert all(a.data.ptr != x.data.ptr for x in kept + [o_full, lse_full])
        _same_bits(o, o_full, "o")
        _same_bits(lse, lse_full, "lse")
        kept += [o, lse]
    o1 = cuflash.attention(q, k, v, causal=causal)   # return_lse=False: its own record
    o2 = cuflash.attention(q, k, v, causal=causal)
    assert o1.data.ptr != o2.data.ptr and (o2.shape, o2.dtype) == (o_full.shape, o_full.dtype)
    _same_bits(o2, o_full, "o without lse")
