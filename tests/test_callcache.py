"""The call-signature cache of `attention` (cuflash/_callcache.py) without a GPU: CuPy is replaced
by a stand-in module whose arrays carry shape, strides, dtype and a pointer, and launches are
recorded. A repeated signature skips the checks and the dispatcher yet launches exactly the
parameter block the full path builds for the same buffers; any change of signature takes the
full path again."""
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
        self.data = types.SimpleNamespace(ptr=ptr, device_id=device)
        self.device = types.SimpleNamespace(id=device)
        self.flags = types.SimpleNamespace(c_contiguous=given is None)


@pytest.fixture
def fake(monkeypatch):
    rec = {"launches": [], "checks": 0}
    ptrs = iter(range(1 << 30, 1 << 40, 1 << 20))

    class Device:
        def __init__(self, i):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

    cp = types.ModuleType("cupy")
    cp.ndarray = FakeArray
    cp.float32 = np.float32
    cp.empty = lambda shape, dtype: FakeArray(shape, dtype, ptr=next(ptrs))
    cp.cuda = types.SimpleNamespace(Device=Device,
                                   get_current_stream=lambda: types.SimpleNamespace(ptr=0))
    monkeypatch.setitem(sys.modules, "cupy", cp)

    def kernel(grid, block, args, shared_mem=0, stream=None):
        rec["launches"].append((grid, block, bytes(np.asarray(args[0]).tobytes()), shared_mem))

    monkeypatch.setattr(_compile, "get_kernel", lambda spec, dev, smem=0: kernel)
    monkeypatch.setitem(_launch._DEVICE_ATTRS, 0, {"compute_capability": 80,
                                                  "max_smem_optin": 232448, "sm_count": 108})
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


def test_hopper_hits_reencode_tensor_maps_for_new_pointers(fake, monkeypatch):
    """The Hopper kernel's tensor maps hold the pointers: a hit with new pointers builds the
    same block the full path builds for them (maps included); the last pointers reuse it."""
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


def test_signature_refuses_other_array_types():
    q = np.zeros((4, 8), np.float32)
    assert _callcache.signature(q, q, q, False, None, False, None, "auto", None) is None
