"""The call-signature cache of `attention` (cuflash/_callcache.py) without a GPU: CuPy is replaced
by a stand-in module whose arrays carry shape, strides, dtype and a pointer, and launches are
recorded. A repeated signature skips the checks and the dispatcher yet launches exactly the
parameter block(s) the full path builds for the same buffers, on the dense kernels and on the
decode kernel (its split-KV kernel and combine; the partials allocated per call on the launch
stream, or the caller's workspace); any change of signature takes the full path again. The GPU
twin is tests/test_callcache_gpu.py."""
import ctypes
import sys
import types

import numpy as np
import pytest

import cuflash
from cuflash import _callcache, _checks, _compile, _launch


class FakeArray:
    def __init__(self, shape, dtype="float16", ptr=1 << 20, strides=None, device=0):
        given = strides
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)
        self.itemsize, self.ndim = self.dtype.itemsize, len(shape)
        if strides is None:
            strides, acc = [], self.itemsize
            for n in reversed(self.shape):
                strides.insert(0, acc)
                acc *= n
        self.strides = tuple(strides)
        self.nbytes = int(np.prod(self.shape)) * self.itemsize
        self.data = types.SimpleNamespace(ptr=ptr, device_id=device)
        self.device = types.SimpleNamespace(id=device)
        self.flags = types.SimpleNamespace(c_contiguous=given is None)

    def reshape(self, shape):
        """A view (never a copy: NumPy's shape assignment refuses what needs one), the pointer
        kept; the strides as NumPy gives them for the same layout."""
        base = np.lib.stride_tricks.as_strided(np.empty(1, self.dtype), self.shape,
                                               self.strides)
        view = base.view()
        view.shape = (shape,) if isinstance(shape, int) else tuple(shape)
        y = FakeArray(view.shape, self.dtype, ptr=self.data.ptr, strides=view.strides,
                      device=self.data.device_id)
        y.flags.c_contiguous = view.flags.c_contiguous
        return y

    def view(self, dtype):
        """The same bytes as another dtype (C-contiguous arrays: flat byte views)."""
        dt = np.dtype(dtype)
        n = self.nbytes // dt.itemsize
        return FakeArray((n,), dt, ptr=self.data.ptr, device=self.data.device_id)


class Stream:
    """A stand-in CUDA stream: entering it makes it CuPy's current stream."""

    stack = []

    def __init__(self, ptr):
        self.ptr = ptr

    def __enter__(self):
        Stream.stack.append(self)
        return self

    def __exit__(self, *a):
        Stream.stack.pop()
        return False


DEFAULT_STREAM = Stream(0)


class CPointer:
    """A stand-in `cupy.cuda.function.CPointer`: a kernel argument passed by address."""

    def __init__(self, ptr):
        self.ptr = ptr


def _arg_bytes(arg, spec):
    """The parameter bytes a kernel receives *at its launch*: a NumPy scalar's, or for a
    `CPointer` the bytes at its address then (the size of the kernel family's block), as
    `cuLaunchKernel` copies them."""
    if not isinstance(arg, CPointer):
        return bytes(np.asarray(arg).tobytes())
    from cuflash import _decode

    size = {"attn_decode": _decode.DECODE_PARAMS_DTYPE.itemsize,
            "attn_wgmma": _launch.HOPPER_PARAMS_DTYPE.itemsize}.get(
                spec.family, _launch.PARAMS_DTYPE.itemsize)
    return ctypes.string_at(arg.ptr, size)


def _current_stream():
    return (Stream.stack or [DEFAULT_STREAM])[-1]


@pytest.fixture(params=["driver", "cupy-call"])
def fake(monkeypatch, request):
    """A stand-in CuPy: allocations are logged with the stream current at the time, launches
    with their kernel name, grid, block, parameter bytes, shared memory and stream; the device
    switches and the checks are counted.

    Every test runs twice: with the direct launch (``"driver"``: `_callcache.DIRECT_LAUNCH` on,
    the owner thread's hits go through the stand-in ``driver.launchKernel``, counted in
    ``"direct"``) and through CuPy's kernel call (``"cupy-call"``). Each device has its own
    context, current while the device is (CUDA 12's ``cudaSetDevice``; ``"no_ctx"``: none is);
    a kernel launched in another device's context raises, as CUDA does. With ``"ptds"`` set,
    CuPy's kernel call without a stream resolves the null stream (handle 0) to the per-thread
    default stream (handle 2), as CuPy's ``get_current_stream_ptr`` does under
    ``CUPY_CUDA_PER_THREAD_DEFAULT_STREAM=1``."""
    rec = {"launches": [], "checks": 0, "allocs": [], "device_enters": 0, "device": 0,
           "via": request.param, "direct": 0, "no_ctx": False, "ptds": False}
    monkeypatch.setattr(_callcache, "DIRECT_LAUNCH", request.param == "driver")
    ptrs = iter(range(1 << 30, 1 << 40, 1 << 20))

    class Device:
        def __init__(self, i):
            self.id = i

        def __enter__(self):
            rec["device_enters"] += 1
            self.prev, rec["device"] = rec["device"], self.id
            return self

        def __exit__(self, *a):
            rec["device"] = self.prev
            return False

    def empty(shape, dtype):
        shape = (shape,) if isinstance(shape, int) else shape
        a = FakeArray(shape, dtype, ptr=next(ptrs), device=rec["device"])
        rec["allocs"].append((a.data.ptr, int(np.prod(shape)) * a.itemsize,
                              _current_stream().ptr))
        return a

    def ascontiguousarray(x):
        return empty(x.shape, x.dtype)

    cp = types.ModuleType("cupy")
    cp.ndarray = FakeArray
    cp.float32, cp.uint8 = np.float32, np.uint8
    cp.empty = empty
    cp.ascontiguousarray = ascontiguousarray
    by_ptr = {}   # kernel handle -> (the stand-in kernel, its device)

    def ctx_get_current():
        return 0 if rec["no_ctx"] else 0xC7 + rec["device"]   # the current device's context

    def launch_kernel(f, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        assert extra == 0
        assert ctx_get_current(), "CUDA_ERROR_INVALID_CONTEXT: no context current"
        kern, _ = by_ptr[f]
        rec["direct"] += 1
        addr = ctypes.c_uint64.from_address(params).value   # the void*[1]'s one pointer
        kern((gx, gy, gz), (bx, by, bz), (CPointer(addr),), smem, Stream(stream))

    cp.cuda = types.SimpleNamespace(Device=Device, ExternalStream=lambda p, d=-1: Stream(p),
                                   runtime=types.SimpleNamespace(getDevice=lambda: rec["device"]),
                                   get_current_stream=_current_stream,
                                   function=types.SimpleNamespace(CPointer=CPointer),
                                   driver=types.SimpleNamespace(launchKernel=launch_kernel,
                                                                ctxGetCurrent=ctx_get_current))
    monkeypatch.setitem(sys.modules, "cupy", cp)
    monkeypatch.setattr(Stream, "stack", [])

    def get_kernel(spec, dev, smem=0):
        def kernel(grid, block, args, shared_mem=0, stream=None):
            # stream None: CuPy's kernel call launches on the current stream's handle
            # (`get_current_stream_ptr`: under PTDS the null stream's 0 is the per-thread 2)
            if stream is None:
                st = _current_stream().ptr
                st = 2 if st == 0 and rec["ptds"] else st
            else:
                st = stream.ptr
            if rec["device"] != dev:   # (both CuPy's call and the driver's launch in the
                raise RuntimeError(    # current context; CuPy's makes the device's current)
                    f"CUDA_ERROR_INVALID_HANDLE: a device {dev} kernel launched in device "
                    f"{rec['device']}'s context")
            three = lambda t: tuple(t) + (1,) * (3 - len(t))  # noqa: E731 (CUDA's dim3)
            rec["launches"].append((three(grid), three(block), _arg_bytes(args[0], spec),
                                    shared_mem, spec.name, st))
        kernel.ptr = 0x5000 + len(by_ptr)
        by_ptr[kernel.ptr] = (kernel, dev)
        return kernel

    monkeypatch.setattr(_compile, "get_kernel", get_kernel)
    for dev in (0, 1):
        monkeypatch.setitem(_launch._DEVICE_ATTRS, dev, {"compute_capability": 80,
                                                        "max_smem_optin": 232448,
                                                        "sm_count": 108})
    real = _checks.check_attention

    def counting(*a, **kw):
        rec["checks"] += 1
        return real(*a, **kw)

    monkeypatch.setattr(_checks, "check_attention", counting)
    monkeypatch.setattr(_launch, "_PARAM_CACHE", type(_launch._PARAM_CACHE)())
    return rec


def _qkv(base=1 << 20, shape=(2, 4, 100, 64), dtype="float16"):
    return [FakeArray(shape, dtype, ptr=base + i * (1 << 24)) for i in range(3)]


def test_repeated_signature_skips_checks_and_launches_the_same_block(fake):
    q, k, v = _qkv()
    cuflash.attention(q, k, v, causal=True)
    assert fake["checks"] == 1
    q2, k2, v2 = _qkv(base=1 << 32)          # other pointers, same signature
    o_hit = cuflash.attention(q2, k2, v2, causal=True)
    assert fake["checks"] == 1, "a repeated signature must not rerun the checks"
    hit = fake["launches"][-1]
    # (the owner thread's hit goes through the driver exactly when the direct launch is on)
    assert fake["direct"] == (fake["via"] == "driver" and _callcache.HOST_BLOCK)
    _callcache.clear()
    o_full = cuflash.attention(q2, k2, v2, causal=True)
    assert fake["checks"] == 2
    full = fake["launches"][-1]
    # the same block but for o's pointer (a fresh allocation each call)
    p_hit = np.frombuffer(hit[2], dtype=_launch.PARAMS_DTYPE).copy()[0]
    p_full = np.frombuffer(full[2], dtype=_launch.PARAMS_DTYPE).copy()[0]
    assert int(p_hit["o"]) == o_hit.data.ptr and int(p_full["o"]) == o_full.data.ptr
    p_hit["o"] = p_full["o"]
    assert p_hit.tobytes() == p_full.tobytes() and hit[:2] == full[:2] and hit[3] == full[3]
    assert int(p_hit["q"]) == q2.data.ptr and int(p_hit["v"]) == v2.data.ptr


def test_out_and_lse_buffers_are_used(fake):
    q, k, v = _qkv()
    o, lse = FakeArray((2, 4, 100, 64), ptr=7 << 28), FakeArray((2, 4, 100), "float32", 9 << 28)
    for _ in range(2):
        res = cuflash.attention(q, k, v, return_lse=True, out=(o, lse))
        assert res[0] is o and res[1] is lse
        p = np.frombuffer(fake["launches"][-1][2], dtype=_launch.PARAMS_DTYPE)[0]
        assert int(p["o"]) == o.data.ptr and int(p["lse"]) == lse.data.ptr
    assert fake["checks"] == 1


@pytest.mark.parametrize("change", [
    lambda a: dict(a, causal=False),
    lambda a: dict(a, scale=0.5),
    lambda a: dict(a, kernel="generic"),
    lambda a: dict(a, q=FakeArray((2, 4, 100, 64), ptr=(1 << 20) + 8)),     # misaligned
    lambda a: dict(a, q=FakeArray((2, 4, 101, 64))),                          # shape
    lambda a: dict(a, q=FakeArray((2, 4, 100, 64), strides=(2 * 64 * 4 * 100, 2 * 64,
                                                            2 * 64 * 4, 2))),  # strides
    lambda a: dict(a, return_lse=True),
    lambda a: dict(a, causal=1),   # not a bool: the full path must raise
])
def test_any_change_of_signature_takes_the_full_path(fake, change):
    q, k, v = _qkv()
    args = dict(q=q, k=k, v=v, causal=True)
    cuflash.attention(**args)
    assert fake["checks"] == 1
    new = change(args)
    try:
        cuflash.attention(**new)
    except TypeError:
        assert new["causal"] == 1
    assert fake["checks"] == 2


def test_errors_still_raise_after_a_recorded_call(fake):
    q, k, v = _qkv()
    cuflash.attention(q, k, v)
    with pytest.raises(ValueError, match="finite"):
        cuflash.attention(q, k, v, scale=float("nan"))
    with pytest.raises(ValueError, match="shape"):
        cuflash.attention(q, k, v, out=FakeArray((2, 4, 100, 32)))
    with pytest.raises(TypeError, match="stream"):
        cuflash.attention(q, k, v, stream=object())  # the stream is resolved on every call


def _fake_hopper(monkeypatch):
    """A compute capability 9.0 device with the tensor-map API, whose encoder returns a digest
    of its arguments; the list of encoded addresses (appended to at each encode)."""
    from cuflash import _tma
    import hashlib

    encoded = []

    def encode(dtype_name, address, dims, strides, box):
        encoded.append(address)
        return hashlib.sha256(repr((address, dims, strides, box)).encode()).digest() * 4

    monkeypatch.setattr(_tma, "encode_tiled", encode)
    monkeypatch.setattr(_tma, "available", lambda: True)
    monkeypatch.setitem(_launch._DEVICE_ATTRS, 0, {"compute_capability": 90,
                                                  "max_smem_optin": 232448, "sm_count": 132})
    return encoded


def test_hopper_hits_reencode_tensor_maps_for_new_pointers(fake, monkeypatch):
    """The Hopper kernel's tensor maps hold the pointers: a hit with new pointers builds the
    same block the full path builds for them (maps included); the last pointers reuse it."""
    encoded = _fake_hopper(monkeypatch)
    assert cuflash.dispatch_info(*_qkv(), causal=True).startswith("hopper")
    o = FakeArray((2, 4, 100, 64), ptr=3 << 36)
    cuflash.attention(*_qkv(), causal=True, out=o)
    q2 = _qkv(base=1 << 33)
    n = len(encoded)
    cuflash.attention(*q2, causal=True, out=o)
    assert fake["checks"] == 2  # dispatch_info and the first call
    assert encoded[n:] == [x.data.ptr for x in q2]
    hit = fake["launches"][-1]
    cuflash.attention(*q2, causal=True, out=o)  # the same pointers: no new maps
    assert len(encoded) == n + 3 and fake["launches"][-1] == hit
    _callcache.clear()
    monkeypatch.setattr(_launch, "_PARAM_CACHE", type(_launch._PARAM_CACHE)())
    cuflash.attention(*q2, causal=True, out=o)
    assert fake["checks"] == 3 and fake["launches"][-1] == hit
    # the same inputs with another output (a fresh o each call without out=): the maps (made
    # from q, k, v only) are kept, o is written in; the block is the full path's for that o
    o2 = FakeArray((2, 4, 100, 64), ptr=5 << 36)
    n = len(encoded)
    cuflash.attention(*q2, causal=True, out=o2)
    assert fake["checks"] == 3 and len(encoded) == n
    hit2 = fake["launches"][-1]
    assert hit2 != hit
    _callcache.clear()
    monkeypatch.setattr(_launch, "_PARAM_CACHE", type(_launch._PARAM_CACHE)())
    cuflash.attention(*q2, causal=True, out=o2)
    assert fake["checks"] == 4 and fake["launches"][-1] == hit2


def test_hopper_alternating_inputs_keep_their_tensor_maps(fake, monkeypatch):
    """Inputs at a few alternating addresses (as XLA may hand a jitted callback): each set's
    maps are encoded once and kept; every launch is the full path's block for its pointers."""
    encoded = _fake_hopper(monkeypatch)
    o = FakeArray((2, 4, 100, 64), ptr=3 << 36)
    sets = [_qkv(base=b) for b in (1 << 33, 1 << 34, 1 << 35)]
    cuflash.attention(*sets[0], causal=True, out=o)   # the full path (its maps recorded)
    n = len(encoded)
    hits = []
    for i in (1, 0, 2, 1, 0, 2, 2, 1):
        cuflash.attention(*sets[i], causal=True, out=o)
        hits.append((i, fake["launches"][-1]))
    assert fake["checks"] == 1
    assert len(encoded) - n == 2 * 3, "each new input set's three maps are encoded once"
    for i, hit in hits:
        _callcache.clear()
        monkeypatch.setattr(_launch, "_PARAM_CACHE", type(_launch._PARAM_CACHE)())
        cuflash.attention(*sets[i], causal=True, out=o)
        assert fake["launches"][-1] == hit, f"input set {i}"


def test_signature_refuses_other_array_types():
    q = np.zeros((4, 8), np.float32)
    assert _callcache.signature(q, q, q, False, None, False, None, "auto", None) is None


# ---------------------------------------------------------------------------------------------
# The decode path (kernel="auto" with few query rows: cuflash/_decode.py) and grouped-query heads

from cuflash import _decode  # noqa: E402

_DEC = _decode.DECODE_PARAMS_DTYPE
#: DecodeParams fields that hold per-call addresses (the outputs and the split partials).
_PER_CALL = ("o", "lse", "o_part", "lse_part")


def _dec_block(launch):
    return np.frombuffer(launch[2], dtype=_DEC).copy()[0]


def _same_but_per_call(hit, full, what):
    """Two launch logs of one signature: the same kernels, grids, blocks, shared memory and
    streams, and the same parameter bytes but for the per-call addresses."""
    assert len(hit) == len(full), what
    for h, f in zip(hit, full):
        assert h[:2] == f[:2] and h[3:] == f[3:], what
        ph, pf = _dec_block(h), _dec_block(f)
        for name in _PER_CALL:
            ph[name] = pf[name]
        assert ph.tobytes() == pf.tobytes(), what


def _new(shape, dtype="float16", ptr=None, _it=iter(range(1 << 41, 1 << 50, 1 << 24))):
    return FakeArray(shape, dtype, ptr=next(_it) if ptr is None else ptr)


_DECODE_CASES = [  # (q shape, k/v shape, causal): all take the decode kernel with kernel="auto"
    ((1, 1, 16, 64), (1, 1, 16, 64), False),          # issue 13's host-time shape: one split
    ((2, 4, 1, 64), (2, 4, 4096, 64), True),          # Sq = 1 causal, split keys (combine)
    ((2, 4, 7, 128), (2, 4, 1000, 128), False),       # Sq = 7
    ((1, 8, 16, 64), (1, 2, 1024, 64), False),        # grouped-query heads (4 per kv head)
    ((3, 8, 1, 128), (3, 1, 777, 128), False),        # multi-query (a broadcast kv head)
]


@pytest.mark.parametrize("return_lse", [False, True])
@pytest.mark.parametrize("with_out", [False, True, "o_only"])
@pytest.mark.parametrize("qs,ks,causal", _DECODE_CASES)
def test_decode_hit_launches_what_the_full_path_launches(fake, qs, ks, causal, with_out,
                                                         return_lse):
    assert cuflash.dispatch_info(_new(qs), _new(ks), _new(ks), causal=causal).startswith(
        "decode<"), "the case must take the decode kernel"
    fake["checks"] = 0
    lse_shape = qs[:-1]

    def outs():
        if not with_out:
            return None
        o = _new(qs)
        return (o, _new(lse_shape, "float32")) if return_lse and with_out is True else o

    kw = dict(causal=causal, return_lse=return_lse)
    cuflash.attention(_new(qs), _new(ks), _new(ks), out=outs(), **kw)   # full path, recorded
    q, k, v, out = _new(qs), _new(ks), _new(ks), outs()
    n = len(fake["launches"])
    res_hit = cuflash.attention(q, k, v, out=out, **kw)
    hit = fake["launches"][n:]
    assert fake["checks"] == 1, "the repeated signature must not rerun the checks"
    _callcache.clear()
    n = len(fake["launches"])
    res_full = cuflash.attention(q, k, v, out=out, **kw)
    full = fake["launches"][n:]
    assert fake["checks"] == 2
    _same_but_per_call(hit, full, "hit against full path")
    splits = int(_dec_block(hit[0])["n_splits"])
    assert len(hit) == (2 if splits > 1 else 1)
    o_hit, lse_hit = res_hit if return_lse else (res_hit, None)
    o_full, lse_full = res_full if return_lse else (res_full, None)
    assert o_hit.shape == o_full.shape == qs and o_hit.strides == o_full.strides
    if return_lse:
        assert lse_hit.shape == lse_full.shape == lse_shape
    if with_out:
        assert o_hit is (out[0] if isinstance(out, tuple) else out)
        assert not isinstance(out, tuple) or lse_hit is out[1]
    p = _dec_block(hit[0])
    assert (int(p["q"]), int(p["k"]), int(p["v"])) == (q.data.ptr, k.data.ptr, v.data.ptr)
    assert int(p["o"]) == o_hit.data.ptr
    assert int(p["lse"]) == (lse_hit.data.ptr if return_lse else 0)
    if splits > 1:   # the partials: a fresh pool block of this call, on the launch stream
        assert _dec_block(hit[1]).tobytes() == p.tobytes(), "both kernels read one block"
        parts = [a for a in fake["allocs"] if a[0] == int(p["o_part"])]
        assert len(parts) == 1 and parts[0][1] >= _decode.dense_workspace_bytes(
            _decode.decode_plan("float16", qs[-1], causal, False),
            _checks.check_attention(q, k, v, causal=causal, scale=None, return_lse=return_lse,
                                    out=out, stream=None, kernel="auto"),
            _launch._DEVICE_ATTRS[0])
    else:
        assert int(p["o_part"]) == int(p["lse_part"]) == 0


def test_decode_partials_are_per_call_and_on_the_launch_stream(fake):
    """Two hits on two streams never share a partials block: each allocates its own with its
    launch stream current, so CuPy's pool hands it on only in that stream's order."""
    qs, ks = (2, 4, 1, 64), (2, 4, 4096, 64)
    s1, s2 = Stream(0x1100), Stream(0x2200)
    cuflash.attention(_new(qs), _new(ks), _new(ks), stream=s1)
    n_alloc, n = len(fake["allocs"]), len(fake["launches"])
    for st in (s1, s2, s1):
        cuflash.attention(_new(qs), _new(ks), _new(ks), stream=st)
    assert fake["checks"] == 1
    launches = fake["launches"][n:]
    assert [x[5] for x in launches] == [s1.ptr] * 2 + [s2.ptr] * 2 + [s1.ptr] * 2
    parts = [int(_dec_block(x)["o_part"]) for x in launches[::2]]
    assert len(set(parts)) == 3
    by_ptr = {a[0]: a[2] for a in fake["allocs"][n_alloc:]}
    assert [by_ptr[p] for p in parts] == [s1.ptr, s2.ptr, s1.ptr]
    # the outputs come from the current stream, as on the full path
    outs = [int(_dec_block(x)["o"]) for x in launches[::2]]
    assert [by_ptr[p] for p in outs] == [0, 0, 0]


def test_decode_hit_uses_the_callers_workspace(fake):
    qs, ks = (2, 4, 1, 64), (2, 4, 4096, 64)
    size = cuflash.attention_workspace_size(_new(qs), _new(ks), _new(ks))
    assert size > 0
    ws = _new((size,), "uint8", ptr=5 << 40)
    fake["checks"] = 0
    cuflash.attention(_new(qs), _new(ks), _new(ks), workspace=ws, out=_new(qs))
    n_alloc, n = len(fake["allocs"]), len(fake["launches"])
    o = _new(qs)
    cuflash.attention(_new(qs), _new(ks), _new(ks), workspace=ws, out=o)
    assert fake["checks"] == 1 and len(fake["allocs"]) == n_alloc, "nothing allocated"
    p = _dec_block(fake["launches"][n])
    assert int(p["o_part"]) == ws.data.ptr and int(p["o"]) == o.data.ptr
    # another workspace signature is checked on the full path
    with pytest.raises(ValueError, match="attention_workspace_size"):
        cuflash.attention(_new(qs), _new(ks), _new(ks), workspace=_new((size - 256,), "uint8"))
    with pytest.raises(ValueError, match="256-byte boundary"):
        cuflash.attention(_new(qs), _new(ks), _new(ks),
                          workspace=_new((size,), "uint8", ptr=(6 << 40) + 16))
    assert fake["checks"] == 3


@pytest.mark.parametrize("change", [
    lambda a: dict(a, q=_new((2, 4, 2, 64))),                               # Sq
    lambda a: dict(a, k=_new((2, 4, 4000, 64)), v=_new((2, 4, 4000, 64))),  # Sk
    lambda a: dict(a, q=_new((2, 4, 1, 64), "bfloat16"), k=_new((2, 4, 4096, 64), "bfloat16"),
                   v=_new((2, 4, 4096, 64), "bfloat16")),                   # dtype
    lambda a: dict(a, q=FakeArray((2, 4, 1, 64), ptr=1 << 44, device=1),
                   k=FakeArray((2, 4, 4096, 64), ptr=2 << 44, device=1),
                   v=FakeArray((2, 4, 4096, 64), ptr=3 << 44, device=1)),   # device
    lambda a: dict(a, q=_new((2, 4, 1, 64), ptr=(1 << 45) + 8)),            # alignment
    lambda a: dict(a, k=FakeArray((2, 4, 4096, 64), ptr=1 << 46,
                                  strides=(4 * 4096 * 128, 128, 4 * 128, 2))),   # strides
    lambda a: dict(a, causal=False),
    lambda a: dict(a, kernel="tensorcore"),
    lambda a: dict(a, return_lse=True),
])
def test_any_change_of_a_decode_signature_takes_the_full_path(fake, change):
    args = dict(q=_new((2, 4, 1, 64)), k=_new((2, 4, 4096, 64)), v=_new((2, 4, 4096, 64)),
                causal=True)
    cuflash.attention(**args)
    cuflash.attention(**dict(args, q=_new((2, 4, 1, 64))))
    assert fake["checks"] == 1
    new = change(args)
    n = len(fake["launches"])
    cuflash.attention(**new)
    assert fake["checks"] == 2
    if new.get("kernel") == "tensorcore":
        assert "attn_decode" not in fake["launches"][n][4]


def test_a_swapped_decode_threshold_is_not_served_from_an_old_record(fake, monkeypatch):
    q, k = _new((1, 1, 16, 64)), _new((1, 1, 16, 64))
    cuflash.attention(q, k, k)
    assert "attn_decode" in fake["launches"][-1][4]
    monkeypatch.setattr(_decode, "DECODE_MAX_SQ", 8)
    cuflash.attention(q, k, k)
    assert fake["checks"] == 2 and "attn_decode" not in fake["launches"][-1][4]


def test_no_device_switch_when_the_records_device_is_current(fake):
    q, k = _new((1, 1, 16, 64)), _new((1, 1, 16, 64))
    cuflash.attention(q, k, k)
    enters = fake["device_enters"]
    cuflash.attention(q, k, k)
    assert fake["checks"] == 1 and fake["device_enters"] == enters
    q1, k1 = (FakeArray((1, 1, 16, 64), ptr=p << 40, device=1) for p in (1, 2))
    cuflash.attention(q1, k1, k1)
    cuflash.attention(q1, k1, k1)   # a hit on device 1 while device 0 is current: switches
    assert fake["checks"] == 2 and fake["device_enters"] == enters + 2
    assert fake["allocs"][-1][0] == int(_dec_block(fake["launches"][-1])["o"])


def test_a_copied_input_is_never_served_from_a_record(fake):
    """An input whose last axis is not contiguous is copied by the checks; the kernels read the
    copy, so a record of that call would launch on the caller's buffer with the copy's strides.
    Such signatures always take the full path."""
    qs = (2, 4, 16, 64)
    k = _new((2, 4, 100, 64))
    q = FakeArray(qs, ptr=1 << 47, strides=(2 * 4 * 16 * 64 * 2, 2 * 16 * 64 * 2, 2 * 64 * 2, 4))
    for kern in ("auto", "tensorcore"):
        cuflash.attention(q, k, k, kernel=kern)
        cuflash.attention(q, k, k, kernel=kern)
    assert fake["checks"] == 4
    assert int(np.frombuffer(fake["launches"][-1][2], dtype=_launch.PARAMS_DTYPE)[0]["q"]) \
        != q.data.ptr


@pytest.mark.parametrize("return_lse", [False, True])
def test_grouped_query_dense_hit(fake, return_lse):
    """Grouped-query calls on the dense kernels are recorded too; a hit returns outputs in the
    caller's head layout and launches the full path's block."""
    qs, ks = (2, 8, 100, 64), (2, 2, 100, 64)
    assert cuflash.dispatch_info(_new(qs), _new(ks), _new(ks)).startswith("tensorcore")
    fake["checks"] = 0

    def outs():
        o = _new(qs)
        return (o, _new(qs[:-1], "float32")) if return_lse else o

    cuflash.attention(_new(qs), _new(ks), _new(ks), return_lse=return_lse)
    cuflash.attention(_new(qs), _new(ks), _new(ks), return_lse=return_lse, out=outs())
    q, k, v, out = _new(qs), _new(ks), _new(ks), outs()
    res_hit = cuflash.attention(q, k, v, return_lse=return_lse, out=out)
    hit = fake["launches"][-1]
    res_hit2 = cuflash.attention(q, k, v, return_lse=return_lse)
    assert fake["checks"] == 2
    o2 = res_hit2[0] if return_lse else res_hit2
    assert o2.shape == qs and (not return_lse or res_hit2[1].shape == qs[:-1])
    assert (res_hit[0] is out[0] and res_hit[1] is out[1]) if return_lse else res_hit is out
    _callcache.clear()
    cuflash.attention(q, k, v, return_lse=return_lse, out=out)
    assert fake["checks"] == 3 and fake["launches"][-1] == hit


def test_an_unhashable_argument_takes_the_full_path(fake):
    q, k = _new((1, 1, 16, 64)), _new((1, 1, 16, 64))
    for _ in range(2):
        with pytest.raises((TypeError, ValueError)):
            cuflash.attention(q, k, k, precision=["highest"])
    assert fake["checks"] == 2 and not _callcache._CACHE


def test_jax_callback_launches_decode_records_on_xlas_stream(fake):
    """cuflash.jax's forward callback launches a recorded decode call with XLA's pointers on
    XLA's stream: the partials from the pool with that stream current, or the kept workspace."""
    cj = pytest.importorskip("cuflash.jax")
    qs, ks = (2, 4, 1, 64), (2, 4, 4096, 64)
    q, k, v = _new(qs), _new(ks), _new(ks)
    cuflash.attention(q, k, v)
    rec = _callcache.lookup(_callcache.signature(q, k, v, False, None, False, None, "auto",
                                                 None))
    assert isinstance(rec, _callcache._DecodeRecord) and rec.part_bytes > 0
    ptrs = (1 << 44, 2 << 44, 3 << 44, 4 << 44, 0)
    n_alloc, n = len(fake["allocs"]), len(fake["launches"])
    cj._launch_record(rec, 0, ptrs, 0xABC0, None)
    dec, comb = fake["launches"][n:]
    assert dec[5] == comb[5] == 0xABC0 and "combine" in comb[4]
    p = _dec_block(dec)
    assert tuple(int(p[f]) for f in ("q", "k", "v", "o", "lse")) == ptrs
    (part,) = fake["allocs"][n_alloc:]
    assert part[0] == int(p["o_part"]) and part[2] == 0xABC0 and part[1] == rec.part_bytes
    ws = _new((rec.part_bytes,), "uint8")
    cj._launch_record(rec, 0, ptrs, 0xABC0, ws)
    assert len(fake["allocs"]) == n_alloc + 1
    assert int(_dec_block(fake["launches"][-2])["o_part"]) == ws.data.ptr


# ---------------------------------------------------------------------------------------------
# The hit path's shortcuts (notes/JAX.md "Toward 10 us per call"): each must keep a hit exactly
# the full path's launch.

def _full_launches(fake, fn):
    """The launches `fn()` makes on the full path (cache cleared first), and its result."""
    _callcache.clear()
    n = len(fake["launches"])
    res = fn()
    return fake["launches"][n:], res


@pytest.mark.parametrize("qs,ks", [((2, 4, 100, 64), (2, 4, 100, 64)),      # dense
                                   ((2, 4, 1, 64), (2, 4, 4096, 64))])      # decode, split keys
def test_another_thread_builds_its_own_block(fake, qs, ks):
    """The record's host block belongs to the thread that made it: a hit on another thread
    launches the full path's bytes for its own pointers and leaves the host block alone."""
    import threading

    out = _new(qs)
    cuflash.attention(_new(qs), _new(ks), _new(ks), out=out)   # recorded on this thread
    q, k, v = _new(qs), _new(ks), _new(ks)
    cuflash.attention(q, k, v, out=out)                        # an owner hit
    rec = _callcache._last[1]
    if not _callcache.HOST_BLOCK:   # CUFLASH_HOST_BLOCK=0: every thread builds its block
        assert rec.host_args is None
    else:
        assert rec.host_args is not None and rec.owner == threading.get_ident()
    host = bytes(rec.host) if rec.host_args is not None else None
    q2, k2, v2 = _new(qs), _new(ks), _new(ks)
    n, nd = len(fake["launches"]), fake["direct"]
    t = threading.Thread(target=lambda: cuflash.attention(q2, k2, v2, out=out))
    t.start()
    t.join()
    other = fake["launches"][n:]
    assert fake["checks"] == 1 and other, "the other thread's call must be a hit"
    assert fake["direct"] == nd, "another thread launched through the owner's host block"
    assert host is None or bytes(rec.host) == host, "another thread wrote into the owner's block"
    full, _ = _full_launches(fake, lambda: cuflash.attention(q2, k2, v2, out=out))
    if "attn_decode" in full[0][4]:
        _same_but_per_call(other, full, "other thread against the full path")
        assert int(_dec_block(other[0])["q"]) == q2.data.ptr
    else:
        assert other == full


def test_no_stream_given_launches_on_the_current_stream_of_each_call(fake):
    """Without stream= a hit launches on CuPy's current stream at that moment
    (`get_current_stream()`, as the full path does); the decode partials come from the pool with
    that stream current."""
    qs, ks = (2, 4, 1, 64), (2, 4, 4096, 64)
    cuflash.attention(_new(qs), _new(ks), _new(ks))
    s1, s2 = Stream(0x7700), Stream(0x8800)
    n, n_alloc = len(fake["launches"]), len(fake["allocs"])
    for st in (s1, s2, None):
        if st is None:
            cuflash.attention(_new(qs), _new(ks), _new(ks))
        else:
            with st:
                cuflash.attention(_new(qs), _new(ks), _new(ks))
    assert fake["checks"] == 1
    assert [x[5] for x in fake["launches"][n:]] == [0x7700] * 2 + [0x8800] * 2 + [0] * 2
    assert [a[2] for a in fake["allocs"][n_alloc:]] == [0x7700] * 2 + [0x8800] * 2 + [0] * 2


def test_int_and_torch_streams_share_one_external_stream(fake, monkeypatch):
    """stream= as a raw handle or a torch-like stream (``.cuda_stream``): every hit launches on
    that handle, and the ExternalStream for it is made once, not per call."""
    made = []

    def external(p, d=-1):
        made.append((p, d))
        return Stream(p)

    monkeypatch.setattr(sys.modules["cupy"].cuda, "ExternalStream", external)
    q, k = _new((1, 1, 16, 64)), _new((1, 1, 16, 64))
    torch_like = types.SimpleNamespace(cuda_stream=0x5500)
    for stream in (0x4400, 0x4400, torch_like, torch_like, 0x4400):
        cuflash.attention(q, k, k, stream=stream)
    assert fake["checks"] == 1
    assert [x[5] for x in fake["launches"][-5:]] == [0x4400, 0x4400, 0x5500, 0x5500, 0x4400]
    assert made.count((0x4400, 0)) == 1 and made.count((0x5500, 0)) == 1
    with pytest.raises(TypeError, match="stream"):
        cuflash.attention(q, k, k, stream=object())


@pytest.mark.parametrize("module,name", [("_dispatch", "TC_CONFIGS"), ("_dispatch", "plan_for"),
                                         ("_decode", "MAX_SPLITS"), ("_decode", "DECODE_VERSION"),
                                         ("_decode", "DECODE_SPLIT_RULE"),
                                         ("_dispatch", "_unlisted"),
                                         ("_dispatch_variants", "ALIBI_AFFINE"),
                                         ("_dispatch_variants", "VARIANT_FUSED_SCALE")])
def test_any_reassigned_table_misses(fake, monkeypatch, module, name):
    """Reassigning any attribute of `_dispatch`, `_decode` or `_dispatch_variants` (a table, the
    planner, a variant form's flag, one no list names) moves the tables' generation on: records
    made before miss. (The H200 run of 2026-12-02, session g call 2: bench_variants' rows after
    an ALIBI_AFFINE row still launched the affine kernel from a record, as _dispatch_variants
    was not watched.)"""
    import importlib

    mod = importlib.import_module(f"cuflash.{module}")
    q, k = _new((2, 4, 100, 64)), _new((2, 4, 100, 64))
    cuflash.attention(q, k, k)
    cuflash.attention(q, k, k)
    assert fake["checks"] == 1
    monkeypatch.setattr(mod, name, getattr(mod, name, None), raising=False)
    cuflash.attention(q, k, k)
    assert fake["checks"] == 2
    cuflash.attention(q, k, k)
    assert fake["checks"] == 2


def test_alternating_signatures_each_launch_their_own_record(fake):
    """The last-key shortcut: calls alternating between signatures hit the right record each
    time (the launch the full path makes for that call)."""
    qa, ka = _new((2, 4, 100, 64)), _new((2, 4, 100, 64))
    qb, kb = _new((1, 1, 16, 64)), _new((1, 1, 16, 64))
    calls = [lambda: cuflash.attention(qa, ka, ka, causal=True),
             lambda: cuflash.attention(qa, ka, ka, causal=False),
             lambda: cuflash.attention(qb, kb, kb)]
    for c in calls:
        c()
    launches = []
    for i in (0, 1, 2, 1, 0, 2, 2, 0):
        n = len(fake["launches"])
        calls[i]()
        launches.append((i, fake["launches"][n:]))
    assert fake["checks"] == 3
    for i, hit in launches:
        full, _ = _full_launches(fake, calls[i])
        if "attn_decode" in full[0][4]:
            _same_but_per_call(hit, full, f"signature {i}")
        else:
            p_hit, p_full = (np.frombuffer(x[0][2], _launch.PARAMS_DTYPE).copy()[0]
                             for x in (hit, full))
            p_hit["o"] = p_full["o"]
            assert p_hit.tobytes() == p_full.tobytes() and hit[0][4] == full[0][4]
        for c in calls:   # re-record all three
            c()


def test_torch_keys(fake):
    """torch tensors: a sparse one takes the full path (no key: its strides raise); the
    negation bit is in the key."""
    torch = pytest.importorskip("torch")
    x = torch.randn(1, 1, 16, 64)
    assert _callcache.signature_of(x, x, x, False, None, False, None, "auto", None) is not None
    sp = x.reshape(16, 64).to_sparse()
    assert _callcache.signature_of(sp, sp, sp, False, None, False, None, "auto", None) is None
    neg = torch._neg_view(x)
    assert neg.is_neg()
    assert _callcache.signature(neg, x, x, False, None, False, None, "auto", None) != \
        _callcache.signature(x, x, x, False, None, False, None, "auto", None)


class _XlaBuffer:
    """A stand-in for the buffers XLA hands a GPU buffer callback."""

    def __init__(self, shape, dtype, ptr):
        self.shape, self.dtype, self._ptr = tuple(shape), np.dtype(dtype), ptr

    def __dlpack_device__(self):
        return (2, 0)   # kDLCUDA, device 0

    @property
    def __cuda_array_interface__(self):
        return {"shape": self.shape, "typestr": self.dtype.str, "data": (self._ptr, False),
                "version": 2}


@pytest.mark.parametrize("with_lse", [False, True])
@pytest.mark.parametrize("s", [16, 128])   # the decode kernel, a dense kernel
def test_jax_callback_hit_launches_the_full_paths_block(fake, monkeypatch, with_lse, s):
    """cuflash.jax's forward callback on (stand-in) XLA buffers: the first call takes the full
    path and records; a call on other buffers launches the record with their pointers on XLA's
    stream, exactly the block a fresh callback's full path launches for those buffers."""
    jax = pytest.importorskip("jax")
    cj = pytest.importorskip("cuflash.jax")

    def as_array(buf, stream):
        return FakeArray(buf.shape, buf.dtype, ptr=buf.__cuda_array_interface__["data"][0])

    real_view = cj._view

    def view(x, hk):   # the real view's shape and strides, on the stand-in's pointer
        y = real_view(np.empty(x.shape, x.dtype), hk)
        return FakeArray(y.shape, x.dtype, ptr=x.data.ptr, strides=y.strides)

    monkeypatch.setattr(cj, "_as_array", as_array)
    monkeypatch.setattr(cj, "_view", view)
    shape = (1, s, 2, 64)   # (B, S, H, D), JAX's layout
    spec = jax.ShapeDtypeStruct(shape, jax.numpy.float16)
    cfg = cj._config(spec, spec, spec, causal=False, scale=None, precision=None,
                     return_lse=with_lse, kernel="auto", deterministic=False,
                     command_buffer=False)
    ctx = types.SimpleNamespace(stream=0xC0FFEE)

    def buffers():
        q, k, v, o = (_XlaBuffer(shape, "float16", next(_it)) for _ in range(4))
        lse = _XlaBuffer((1, 2, s), "float32", next(_it))
        return (q, k, v), ((o, lse) if with_lse else o)

    _it = iter(range(1 << 42, 1 << 50, 1 << 24))
    cb = cj._fwd_callback(cfg, with_lse)
    qkv, out = buffers()
    cb(ctx, out, *qkv)                        # the full path, recorded
    n = fake["checks"]
    qkv, out = buffers()
    m = len(fake["launches"])
    cb(ctx, out, *qkv)                        # a hit with XLA's pointers
    hit = fake["launches"][m:]
    assert fake["checks"] == n, "the callback's second call must launch its record"
    assert hit and all(x[5] == 0xC0FFEE for x in hit), "on XLA's stream"
    _callcache.clear()
    monkeypatch.setattr(_launch, "_PARAM_CACHE", type(_launch._PARAM_CACHE)())
    m = len(fake["launches"])
    cj._fwd_callback(cfg, with_lse)(ctx, out, *qkv)   # a fresh callback: the full path
    assert fake["checks"] == n + 1
    assert fake["launches"][m:] == hit


@pytest.mark.parametrize("name,before,after", [
    ("DECODE_MAX_SQ", 2, 16),       # a dense plan (no workspace) becomes a split decode one
    ("MAX_SPLITS", 2, 256),         # more splits: more partials
    ("DECODE_VERSION", 1, 2),       # the default's version after version 1's
])
def test_jax_command_buffer_workspace_follows_the_plan_that_runs(fake, monkeypatch, name,
                                                                 before, after):
    """cuflash.jax.attention(command_buffer=True) keeps a workspace per buffer signature for the
    decode kernel's split partials (taken outside the forbidding allocator). It was sized once,
    under the dispatcher's tables of the first call: after a flag switch (DECODE_VERSION, the
    split model, DECODE_MAX_SQ) the next call's plan could need more, or need one where the
    first plan needed none, and the call failed (a too-small workspace's ValueError, or the
    pool allocation command buffers forbid). Every call must get a kept workspace that covers
    the plan it runs under the current flags, and no pool memory inside the forbidding
    allocator."""
    jax = pytest.importorskip("jax")
    cj = pytest.importorskip("cuflash.jax")
    import contextlib

    import cupy as cp

    forbidding = []

    @contextlib.contextmanager
    def using_allocator(fn):
        forbidding.append(fn)
        try:
            yield
        finally:
            forbidding.pop()

    real_empty = cp.empty

    def empty(shape, dtype):
        n = int(np.prod((shape,) if isinstance(shape, int) else shape)) * np.dtype(dtype).itemsize
        if forbidding:
            forbidding[-1](n)   # cj._forbid_pool: raises for any pool memory
        return real_empty(shape, dtype)

    monkeypatch.setattr(cp, "empty", empty)
    monkeypatch.setattr(cp.cuda, "using_allocator", using_allocator, raising=False)
    monkeypatch.setattr(cp.cuda.runtime, "streamIsCapturing", lambda st: 0, raising=False)
    monkeypatch.setattr(cj, "_as_array", lambda buf, stream: FakeArray(
        buf.shape, buf.dtype, ptr=buf.__cuda_array_interface__["data"][0]))
    real_view = cj._view

    def view(x, hk):
        y = real_view(np.empty(x.shape, x.dtype), hk)
        return FakeArray(y.shape, x.dtype, ptr=x.data.ptr, strides=y.strides)

    monkeypatch.setattr(cj, "_view", view)
    qs, ks = (1, 4, 2, 64), (1, 4096, 2, 64)   # (B, S, H, D): few query rows, many keys
    qspec, kspec = (jax.ShapeDtypeStruct(x, jax.numpy.float16) for x in (qs, ks))
    cfg = cj._config(qspec, kspec, kspec, causal=False, scale=None, precision=None,
                     return_lse=False, kernel="auto", deterministic=False, command_buffer=True)
    ctx = types.SimpleNamespace(stream=0xC0FFEE)
    _it = iter(range(1 << 42, 1 << 50, 1 << 24))

    def buffers():
        return [_XlaBuffer(sh, "float16", next(_it)) for sh in (qs, ks, ks, qs)]

    def need(bufs):   # what the call asks for under the flags now
        q, k, v, o = (view(FakeArray(b.shape, b.dtype, ptr=b.__cuda_array_interface__[
            "data"][0]), ks[2]) for b in bufs)
        return cuflash.attention_workspace_size(q, k, v, out=o)

    cb = cj._fwd_callback(cfg, False)
    monkeypatch.setattr(_decode, name, before)
    first = buffers()
    cb(ctx, first[3], *first[:3])
    monkeypatch.setattr(_decode, name, after)
    for _ in range(2):   # the full path under the new flags, then its record's hit
        bufs = buffers()
        m, a = len(fake["launches"]), len(fake["allocs"])
        cb(ctx, bufs[3], *bufs[:3])   # raised before the fix (MAX_SQ, MAX_SPLITS)
        launches = fake["launches"][m:]
        assert launches and all(x[5] == 0xC0FFEE for x in launches)
        want = need(bufs)
        if want:
            assert "attn_decode" in launches[0][4]
            parts = int(_dec_block(launches[0])["o_part"])
            kept = [x for x in fake["allocs"] if x[0] == parts]
            assert kept and kept[0][1] >= want, (kept, want)
            assert all(x[0] == parts for x in fake["allocs"][a:]), "only the kept workspace"


def test_one_visible_device_skips_the_device_check_and_two_keep_it(fake, monkeypatch):
    """With one device visible the current device is the record's: a hit reads no current
    device. With two it reads it on every hit (and a hit from the other device switches)."""
    import cupy as cp

    calls = []

    def get_device():
        calls.append(1)
        return fake["device"]

    monkeypatch.setattr(cp.cuda, "runtime", types.SimpleNamespace(
        getDevice=get_device, getDeviceCount=lambda: 1))
    q, k, v = _qkv()
    cuflash.attention(q, k, v)
    n = len(calls)
    for _ in range(3):
        cuflash.attention(q, k, v)
    assert fake["checks"] == 1 and len(calls) == n, "one device: no getDevice per hit"
    _callcache.clear()
    monkeypatch.setattr(cp.cuda, "runtime", types.SimpleNamespace(
        getDevice=get_device, getDeviceCount=lambda: 2))
    cuflash.attention(q, k, v)
    n = len(calls)
    for _ in range(3):
        cuflash.attention(q, k, v)
    assert fake["checks"] == 2 and len(calls) == n + 3, "two devices: getDevice per hit"
    enters = fake["device_enters"]
    fake["device"] = 1   # another device current: the hit switches to the record's
    cuflash.attention(q, k, v)
    assert fake["checks"] == 2 and fake["device_enters"] == enters + 1


@pytest.mark.parametrize("case", ["dense", "hopper", "decode", "decode split"])
def test_direct_launch_sends_what_cupys_call_sends(fake, monkeypatch, case):
    """`CUFLASH_DIRECT_LAUNCH`: the owner thread's launches through ``driver.launchKernel`` (a
    pre-packed ``void*[1]`` to the host block) send each kernel the bytes, grid, block, shared
    memory and stream that CuPy's ``Function.__call__`` sends; with no context current they go
    through CuPy's call."""
    import cupy as cp

    if case == "hopper":
        _fake_hopper(monkeypatch)
    monkeypatch.setattr(_callcache, "DIRECT_LAUNCH", True)
    monkeypatch.setattr(_callcache, "HOST_BLOCK", True)   # (the direct launch needs it)
    real_get, kernels = _compile.get_kernel, {}

    def get_kernel(spec, dev, smem=0):
        inner = real_get(spec, dev, smem)

        def kern(*a, **kw):
            return inner(*a, **kw)
        kern.ptr = 1000 + len(kernels)
        kernels[kern.ptr] = inner
        return kern

    direct, ctx = [], [1]

    def launch_kernel(f, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        assert extra == 0
        direct.append(f)
        addr = ctypes.c_uint64.from_address(params).value   # the void*[1]'s one pointer
        kernels[f]((gx, gy, gz), (bx, by, bz), (CPointer(addr),), smem,
                   types.SimpleNamespace(ptr=stream))

    monkeypatch.setattr(_compile, "get_kernel", get_kernel)
    monkeypatch.setattr(cp.cuda, "driver", types.SimpleNamespace(
        launchKernel=launch_kernel, ctxGetCurrent=lambda: ctx[0]), raising=False)
    if case in ("dense", "hopper"):
        qs, ks, causal, ws = (2, 4, 100, 64), (2, 4, 100, 64), True, None
    else:
        qs, ks, causal = ((1, 1, 16, 64), (1, 1, 16, 64), False) if case == "decode" else \
            ((2, 4, 1, 64), (2, 4, 4096, 64), True)
        size = cuflash.attention_workspace_size(_new(qs), _new(ks), _new(ks))
        ws = _new((size,), "uint8", ptr=5 << 40) if size else None
    label = cuflash.dispatch_info(_new(qs), _new(ks), _new(ks), causal=causal)
    assert label.startswith({"dense": "tensorcore", "hopper": "hopper"}.get(case, "decode")), \
        label
    kw = dict(causal=causal, workspace=ws)
    cuflash.attention(_new(qs), _new(ks), _new(ks), out=_new(qs), **kw)   # recorded
    rec, checks = _callcache._last[1], fake["checks"]
    assert rec.direct is not None
    q, k, v, o = _new(qs), _new(ks), _new(ks), _new(qs)
    cuflash.attention(q, k, v, out=o, **kw)   # (Hopper: the host block takes these maps)
    logs = {}
    for stream in (None, cp.cuda.ExternalStream(77)):
        n, nd = len(fake["launches"]), len(direct)
        cuflash.attention(q, k, v, out=o, stream=stream, **kw)
        logs[stream] = via_driver = fake["launches"][n:]
        assert len(direct) - nd == len(via_driver) == (2 if case == "decode split" else 1)
        rec.direct, saved = None, rec.direct   # the same call through CuPy's Function.__call__
        n = len(fake["launches"])
        cuflash.attention(q, k, v, out=o, stream=stream, **kw)
        assert fake["launches"][n:] == via_driver
        rec.direct = saved
    assert logs[None] != logs[next(s for s in logs if s is not None)], "the streams differ"
    ctx[0] = 0   # no context current: CuPy's call (which makes one current)
    n, nd = len(fake["launches"]), len(direct)
    cuflash.attention(q, k, v, out=o, **kw)
    assert len(direct) == nd and fake["launches"][n:] == logs[None]
    assert fake["checks"] == checks, "every call after the first is a hit"


@pytest.mark.parametrize("qs,ks", [((2, 4, 100, 64), (2, 4, 100, 64)),      # dense
                                   ((2, 4, 1, 64), (2, 4, 4096, 64))])      # decode, split keys
def test_every_hit_launches_on_the_full_paths_stream_under_ptds(fake, qs, ks):
    """``CUPY_CUDA_PER_THREAD_DEFAULT_STREAM=1`` with ``cupy.cuda.Stream.null`` current: the
    full path launches on ``get_current_stream().ptr``, the legacy stream 0, while CuPy's
    kernel call without a stream resolves 0 to the per-thread default stream 2. A hit without
    stream= launches where the full path does, on every path: the owner thread's (direct or
    CuPy's call), another thread's, and with no context current (CuPy's call)."""
    import threading

    fake["ptds"] = True
    with Stream(0):   # Stream.null current (the stand-in's stack is not per thread)
        full, _ = _full_launches(fake, lambda: cuflash.attention(_new(qs), _new(ks), _new(ks)))
        assert [x[5] for x in full] == [0] * len(full)
        n = len(fake["launches"])
        cuflash.attention(_new(qs), _new(ks), _new(ks))           # the owner thread
        q, k, v = _new(qs), _new(ks), _new(ks)
        t = threading.Thread(target=lambda: cuflash.attention(q, k, v))
        t.start()
        t.join()                                                   # another thread
        fake["no_ctx"] = True
        cuflash.attention(_new(qs), _new(ks), _new(ks))           # no context current
        fake["no_ctx"] = False
    hits = fake["launches"][n:]
    assert fake["checks"] == 1 and len(hits) == 3 * len(full)
    assert [x[5] for x in hits] == [0] * len(hits), "a hit left the full path's stream"


@pytest.mark.parametrize("qs,ks", [((2, 4, 100, 64), (2, 4, 100, 64)),      # dense
                                   ((2, 4, 1, 64), (2, 4, 4096, 64))])      # decode, split keys
def test_two_devices_hits_launch_in_the_records_devices_context(fake, monkeypatch, qs, ks):
    """Two devices visible, a record for device 1: a hit while device 0 is current switches to
    device 1 for the launch (the stand-in raises for a kernel launched in another device's
    context, through the driver or CuPy's call), after ``Device(1).use()`` it launches without
    a switch; both launch the full path's blocks; the other device's signature has its own
    record."""
    import cupy as cp

    monkeypatch.setattr(cp.cuda.runtime, "getDeviceCount", lambda: 2, raising=False)

    def on(dev, *shapes):
        return [FakeArray(s, "float16", ptr=next(_ptrs), device=dev) for s in shapes]

    _ptrs = iter(range(1 << 41, 1 << 50, 1 << 24))
    cuflash.attention(*on(1, qs, ks, ks))   # recorded (device 0 current: the full path switches)
    rec = _callcache._last[1]
    assert rec.device_id == 1 and not rec.single and fake["device"] == 0
    q, k, v, o = on(1, qs, ks, ks, qs)
    cuflash.attention(q, k, v, out=o)                # recorded with out= (o's pointer fixed)
    checks = fake["checks"]
    n, enters = len(fake["launches"]), fake["device_enters"]
    cuflash.attention(q, k, v, out=o)                # device 0 current
    from_0 = fake["launches"][n:]
    assert fake["checks"] == checks and fake["device_enters"] == enters + 1
    fake["device"] = 1                               # Device(1).use()
    n, enters = len(fake["launches"]), fake["device_enters"]
    cuflash.attention(q, k, v, out=o)
    from_1 = fake["launches"][n:]
    assert fake["checks"] == checks and fake["device_enters"] == enters
    fake["device"] = 0
    full, _ = _full_launches(fake, lambda: cuflash.attention(q, k, v, out=o))
    if "attn_decode" in full[0][4]:   # (the split partials: a fresh pool block each call)
        _same_but_per_call(from_0, full, "from device 0")
        _same_but_per_call(from_1, full, "from device 1")
    else:
        assert from_0 == from_1 == full
    cuflash.attention(*on(0, qs, ks, ks), out=on(0, qs)[0])   # device 0's: another signature
    assert fake["checks"] == checks + 2 and _callcache._last[1].device_id == 0


# --- the no-out= hit's fresh outputs (issue 13: host time without out=) -----------------------

def _meta(a):
    return (type(a), a.shape, a.strides, a.dtype, a.data.device_id)


@pytest.mark.parametrize("qs, ks, return_lse", [((1, 1, 16, 64), (1, 1, 16, 64), False),
                                                ((1, 1, 128, 64), (1, 1, 128, 64), True),
                                                ((2, 4, 1, 64), (2, 4, 4096, 64), False)])
def test_each_hit_returns_a_fresh_output_like_the_full_paths(fake, qs, ks, return_lse):
    """A hit without out= returns new arrays each call (never a previous result's memory) with
    the full path's shape, strides, dtype and device, and launches on them."""
    q, k, v = _new(qs), _new(ks), _new(ks)
    full = cuflash.attention(q, k, v, return_lse=return_lse)
    assert fake["checks"] == 1
    hits = [cuflash.attention(q, k, v, return_lse=return_lse) for _ in range(3)]
    assert fake["checks"] == 1
    seen = set()
    for res in hits:
        outs = res if return_lse else (res,)
        for a, b in zip(outs, full if return_lse else (full,)):
            assert _meta(a) == _meta(b) and a is not b
            assert a.data.ptr not in seen
            seen.add(a.data.ptr)
    p = np.frombuffer(fake["launches"][-1][2][:16 * 8], np.uint64)
    last = hits[-1] if return_lse else (hits[-1],)
    assert int(p[3]) == last[0].data.ptr and (not return_lse or int(p[4]) == last[1].data.ptr)


def test_a_record_is_not_used_under_another_cupy_module(fake, monkeypatch):
    """A record keeps the CuPy module's allocation function: under another `cupy` module the
    call takes the full path (which records anew) instead of allocating with the old one."""
    q, k, v = _qkv()
    cuflash.attention(q, k, v)
    cuflash.attention(q, k, v)
    assert fake["checks"] == 1
    cp2 = types.ModuleType("cupy")
    cp2.__dict__.update(sys.modules["cupy"].__dict__)
    made = []
    cp2.empty = lambda shape, dtype: made.append(shape) or FakeArray(shape, dtype, ptr=5 << 36)
    monkeypatch.setitem(sys.modules, "cupy", cp2)
    o = cuflash.attention(q, k, v)
    assert fake["checks"] == 2 and o.data.ptr == 5 << 36 and made
    o = cuflash.attention(q, k, v)
    assert fake["checks"] == 2 and o.data.ptr == 5 << 36 and len(made) == 2


def test_the_dtype_argument_names_the_same_dtype():
    """`_dtype_arg` passes the scalar type only where it names the same dtype (else the dtype)."""
    for name in ("float16", "float32", "float64", "uint8"):
        dt = np.dtype(name)
        assert _callcache._dtype_arg(dt) is dt.type and np.dtype(dt.type) == dt
    dt = np.dtype([("a", np.float32)])   # a structured dtype: its type (np.void) names V1
    assert _callcache._dtype_arg(dt) is dt
    ml = pytest.importorskip("ml_dtypes")
    dt = np.dtype(ml.bfloat16)
    assert np.dtype(_callcache._dtype_arg(dt)) == dt


def _installed_cupy(_mod=[]):
    """The installed CuPy module (imported once, past any stand-in in sys.modules), or None."""
    if not _mod:
        import importlib

        saved = sys.modules.pop("cupy", None)
        try:
            _mod.append(importlib.import_module("cupy"))
        except Exception:  # no CuPy here
            _mod.append(None)
        finally:
            if saved is not None:
                sys.modules["cupy"] = saved
    return _mod[0]


@pytest.fixture
def real_cupy():
    """The installed CuPy (needs no GPU for this) with a Python allocator handing out distinct
    host addresses, restored after the test; the allocations are counted."""
    cupy = _installed_cupy()
    if cupy is None:
        pytest.skip("CuPy does not import here")
    from cupy.cuda import memory

    buf = np.zeros(1 << 22, np.uint8)
    mem = memory.UnownedMemory(buf.ctypes.data, buf.nbytes, buf, 0)
    count = []

    def alloc(nbytes):
        count.append(nbytes)
        return memory.MemoryPointer(mem, (len(count) * 4096) % (1 << 21))
    prev = cupy.cuda.get_allocator()
    cupy.cuda.set_allocator(alloc)
    yield cupy, count
    cupy.cuda.set_allocator(prev)


@pytest.mark.parametrize("flag", [False, True])
def test_fast_empty_builds_what_cupy_empty_builds(real_cupy, monkeypatch, flag):
    """CUFLASH_FAST_EMPTY's constructor gives, for real CuPy, the array ``cupy.empty`` gives:
    type, shape, strides, dtype, flags, no base, size, and one allocation through the current
    allocator per call (a fresh pointer each time)."""
    cupy, count = real_cupy
    monkeypatch.setattr(_callcache, "FAST_EMPTY", flag)
    empty = _callcache._fast_empty(cupy)
    assert (empty is cupy.empty) != flag
    for shape, dt in [((1, 1, 16, 64), np.float16), ((2, 3, 5), np.float32), (4096, np.uint8),
                      ((0, 4), np.float32), ((1, 1, 1), np.float64)]:
        n = len(count)
        a, b = empty(shape, dt), cupy.empty(shape, dtype=np.dtype(dt))
        assert len(count) == n + 2 and count[-2] == count[-1]
        assert type(a) is type(b) is cupy.ndarray
        for attr in ("shape", "strides", "dtype", "size", "nbytes", "ndim", "base"):
            assert getattr(a, attr) == getattr(b, attr), attr
        assert (a.flags.c_contiguous, a.flags.f_contiguous, a.flags.owndata) == \
            (b.flags.c_contiguous, b.flags.f_contiguous, b.flags.owndata)
        assert a.data.ptr != b.data.ptr and a.data.device_id == b.data.device_id
        assert a._index_32_bits == b._index_32_bits


@pytest.mark.parametrize("flag", [False, True])
@pytest.mark.parametrize("return_lse", [False, True])
def test_hits_return_real_cupy_arrays_like_the_full_path(fake, real_cupy, monkeypatch, flag,
                                                         return_lse):
    """With CuPy's real empty (and constructor, flag on) behind the stand-in: a hit's outputs
    are fresh `cupy.ndarray`s with the full path's metadata, and the launch writes into them."""
    cupy, count = real_cupy
    cp = sys.modules["cupy"]
    monkeypatch.setattr(cp, "empty", cupy.empty)
    monkeypatch.setattr(cp, "_core", cupy._core, raising=False)
    monkeypatch.setattr(cp, "__version__", cupy.__version__, raising=False)
    monkeypatch.setattr(_callcache, "FAST_EMPTY", flag)
    q, k, v = _qkv(shape=(1, 2, 128, 64))
    full = cuflash.attention(q, k, v, return_lse=return_lse)
    rec = _callcache.lookup(_callcache.signature(q, k, v, False, None, return_lse, None, "auto",
                                                 None))
    assert rec is not None and (rec.empty is not cupy.empty) == flag
    kept = []
    for _ in range(3):
        n = len(count)
        res = cuflash.attention(q, k, v, return_lse=return_lse)
        assert fake["checks"] == 1 and len(count) == n + 1 + return_lse
        outs, ref = (res, full) if return_lse else ((res,), (full,))
        for a, b in zip(outs, ref):
            assert type(a) is cupy.ndarray and _meta(a) == _meta(b) and a.flags.owndata
        p = np.frombuffer(fake["launches"][-1][2][:40], np.uint64)
        assert int(p[3]) == outs[0].data.ptr
        assert int(p[4]) == (outs[1].data.ptr if return_lse else 0)
        assert all(a.data.ptr != b.data.ptr for b in kept for a in outs)
        kept += outs


def test_a_hit_passes_the_dtypes_scalar_type_positionally(fake, monkeypatch):
    """CuPy resolves ``numpy.float16`` (a type in its dict) faster than a NumPy 2 dtype
    instance, and positional arguments faster than keywords: a hit allocates o and lse so."""
    q, k, v = _qkv(shape=(1, 2, 128, 64))
    cuflash.attention(q, k, v, return_lse=True)
    cp = sys.modules["cupy"]
    calls, real = [], cp.empty

    def empty(*a, **kw):
        calls.append((a, kw))
        return real(*a, **kw)
    monkeypatch.setattr(cp, "empty", empty)
    _callcache.clear()
    cuflash.attention(q, k, v, return_lse=True)   # recorded with this module's empty
    calls.clear()
    o, lse = cuflash.attention(q, k, v, return_lse=True)
    assert fake["checks"] == 2 and o.dtype == np.float16 and lse.dtype == np.float32
    assert calls == [(((1, 2, 128, 64), np.float16), {}), (((1, 2, 128), np.float32), {})]


def test_fast_empty_falls_back_where_cupy_differs(real_cupy, monkeypatch):
    """CUFLASH_FAST_EMPTY takes CuPy's private construction steps only on CuPy 14 and only where
    they build what ``cupy.empty`` builds (checked once per CuPy module): another major version,
    or steps that give another array (here: one that ignores the shape), get ``cupy.empty``."""
    cupy, _ = real_cupy
    monkeypatch.setattr(_callcache, "FAST_EMPTY", True)
    monkeypatch.setattr(_callcache, "_FAST_AGREES", {})
    assert _callcache._fast_empty(cupy) is not cupy.empty
    other = types.SimpleNamespace(__version__="15.0.0", empty=cupy.empty, _core=cupy._core)
    assert _callcache._fast_empty(other) is cupy.empty
    assert _callcache._fast_agrees(cupy, lambda shape, dt: cupy.empty(shape, dt)) is True
    # steps that ignore the shape, or hand back a view, are caught
    assert _callcache._fast_agrees(cupy, lambda shape, dt: cupy.empty((1,), dt)) is False
    assert _callcache._fast_agrees(cupy, lambda shape, dt: cupy.empty(shape, dt)[...]) is False
