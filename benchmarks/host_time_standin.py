"""Host time of a call-cache hit without a GPU: CuPy replaced by a stand-in module (arrays that
carry shape, strides, dtype and a pointer; `empty` hands out addresses; kernels are no-ops), so
what is left is cuflash's own Python per call. Prints the whole call (full path and hit) and the
hit's parts (signature, lookup, allocation, packing the block, the kernel call, the stream).

    python benchmarks/host_time_standin.py [--calls 20000] [--s 16,128,1:4096] [--repeats 5]
                                           [--empty standin|real]

``--empty real`` makes the hit's outputs real CuPy arrays (the installed CuPy's ``empty`` and
``ndarray`` constructor, which need no GPU) on host memory handed out by a Python allocator
(``cupy.cuda.set_allocator``): the constructor's cost is then CuPy's own, only the pool's
malloc and free (and the launch) are missing. It also prints the no-``out=`` path's parts:
the allocation as the hit makes it with and without ``CUFLASH_FAST_EMPTY`` and as it was
made before (``cupy.empty(shape, dtype=<numpy dtype>)``), and the hit with the flag on.

``--s`` items are ``S`` (Sq = Sk) or ``S:SK``; the default's ``1:4096`` takes the decode kernel
with split keys (two launches, the split kernel's and the combine's, and the partials'
allocation from the pool).

The numbers are this process's CPU time per call on this machine, best of --repeats runs
(notes/JAX.md "Host time" has the development machine's);
on the GPU add CuPy's real allocation and kernel-launch costs (benchmarks/host_time.py).
"""
import argparse
import sys
import time
import types

import numpy as np


class _Array:
    def __init__(self, shape, dtype="float16", ptr=1 << 20, device=0):
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)
        self.itemsize, self.ndim = self.dtype.itemsize, len(shape)
        strides, acc = [], self.itemsize
        for n in reversed(self.shape):
            strides.insert(0, acc)
            acc *= n
        self.strides = tuple(strides)
        self.nbytes = acc
        self.data = types.SimpleNamespace(ptr=ptr, device_id=device)
        self.device = types.SimpleNamespace(id=device)
        self.flags = types.SimpleNamespace(c_contiguous=True)


class _Stream:
    ptr = 0

    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def _real_empty():
    """The installed CuPy's ``empty`` and ``_core`` with a Python allocator that hands out host
    memory (one buffer, each allocation at its start: the pointers do not matter here), or
    None where CuPy does not import. Imported before the stand-in replaces `cupy`."""
    try:
        import cupy
        from cupy.cuda import memory
    except Exception:  # no CuPy here
        return None
    buf = np.zeros(1 << 24, np.uint8)
    mem = memory.UnownedMemory(buf.ctypes.data, buf.nbytes, buf, 0)
    cupy.cuda.set_allocator(lambda nbytes: memory.MemoryPointer(mem, 0))
    return cupy.empty, cupy._core, buf


def _install(real=None):
    """Put the stand-in CuPy in sys.modules and no-op kernels into cuflash; `real`:
    `_real_empty()`'s (empty, _core) for the outputs."""
    ptrs = iter(range(1 << 30, 1 << 60, 1 << 20))
    stream = _Stream()

    class Device:
        def __init__(self, i):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

    cp = types.ModuleType("cupy")
    cp.ndarray = _Array
    cp.float32, cp.uint8 = np.float32, np.uint8
    cp.empty = lambda shape, dtype: _Array((shape,) if isinstance(shape, int) else shape, dtype,
                                           ptr=next(ptrs))
    if real is not None:
        cp.empty, cp._core = real[0], real[1]
    cp.cuda = types.SimpleNamespace(Device=Device, ExternalStream=lambda p, d=-1: stream,
                                   runtime=types.SimpleNamespace(getDevice=lambda: 0),
                                   get_current_stream=lambda: stream,
                                   function=types.SimpleNamespace(CPointer=_CPOINTER))
    sys.modules["cupy"] = cp
    from cuflash import _compile, _launch

    def kernel(grid, block, args, shared_mem=0, stream=None):
        pass

    _compile.get_kernel = lambda spec, dev, smem=0: kernel
    _launch._DEVICE_ATTRS[0] = {"compute_capability": 90, "max_smem_optin": 232448,
                                "sm_count": 132}
    return cp


def _cupy_scalar():
    """CuPy's kernel-argument wrapper for NumPy scalars, if the real CuPy imports here (it needs
    no GPU), else None. Imported before the stand-in replaces `cupy` in sys.modules."""
    try:
        from cupy._core._scalar import CScalar
    except Exception:  # no CuPy, or another layout of its internals
        return None
    return CScalar


_CSCALAR = None


class _StandinCPointer:
    def __init__(self, ptr):
        self.ptr = ptr


def _cupy_cpointer():
    """CuPy's by-address kernel argument type if the real CuPy imports here, else a stand-in."""
    try:
        from cupy.cuda.function import CPointer
    except Exception:  # no CuPy
        return _StandinCPointer
    return CPointer


_CPOINTER = _StandinCPointer


_REPEATS = 5


def _per_call(fn, calls):
    """Best of `_REPEATS` runs of `calls` calls, thread CPU time (less disturbed by other
    jobs than the wall clock; the best run the least)."""
    fn()
    best = float("inf")
    chunk = max(1, calls // _REPEATS)
    for _ in range(_REPEATS):
        t0 = time.thread_time()
        for _ in range(chunk):
            fn()
        best = min(best, (time.thread_time() - t0) / chunk * 1e6)
    return best


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--s", default="16,128,1:4096")
    ap.add_argument("--sk", type=int, default=0, help="keys (default: Sk = S)")
    ap.add_argument("--repeats", type=int, default=5, help="runs per figure (the best is shown)")
    ap.add_argument("--empty", default="standin", choices=["standin", "real"],
                    help="the hit's outputs: stand-in arrays, or real CuPy arrays on host "
                         "memory (CuPy's constructor; no pool)")
    args = ap.parse_args()
    global _REPEATS
    _REPEATS = max(1, args.repeats)
    global _CSCALAR, _CPOINTER
    _CSCALAR = _cupy_scalar()
    _CPOINTER = _cupy_cpointer()
    real = _real_empty() if args.empty == "real" else None
    if args.empty == "real" and real is None:
        sys.exit("--empty real: CuPy does not import here")
    cp = _install(real)
    import cuflash
    from cuflash import _callcache, _decode, _launch

    n = args.calls
    FAST = getattr(_callcache, "FAST_EMPTY", False)
    for item in args.s.split(","):
        s, _, sk = item.partition(":")
        s = int(s)
        sk = int(sk) if sk else (args.sk or s)
        q = _Array((1, 1, s, 64), ptr=1 << 40)
        k, v = _Array((1, 1, sk, 64), ptr=2 << 40), _Array((1, 1, sk, 64), ptr=3 << 40)
        out = _Array((1, 1, s, 64), ptr=4 << 40)
        label = cuflash.dispatch_info(q, k, v)
        print(f"S = {s}, Sk = {sk}: {label}")

        def full():
            _callcache.clear()
            cuflash.attention(q, k, v)
        rows = [("full path (cache cleared each call)", _per_call(full, max(1, n // 20)))]
        cuflash.attention(q, k, v)
        cuflash.attention(q, k, v, out=out)
        rows.append(("hit", _per_call(lambda: cuflash.attention(q, k, v), n)))
        rows.append(("hit, out=", _per_call(lambda: cuflash.attention(q, k, v, out=out), n)))
        if real is not None and hasattr(_callcache, "FAST_EMPTY"):
            _callcache.FAST_EMPTY = True   # (read when a record is made)
            _callcache.clear()
            cuflash.attention(q, k, v)
            rows.append(("hit, CUFLASH_FAST_EMPTY=1",
                         _per_call(lambda: cuflash.attention(q, k, v), n)))
            _callcache.FAST_EMPTY = FAST
            _callcache.clear()
            cuflash.attention(q, k, v)
            cuflash.attention(q, k, v, out=out)
        cuflash.attention(q, k, v, return_lse=True)
        rows.append(("hit, return_lse=True (o and lse allocated)",
                     _per_call(lambda: cuflash.attention(q, k, v, return_lse=True), n)))
        sig = _callcache.signature_of
        rows.append(("  signature", _per_call(
            lambda: sig(q, k, v, False, None, False, None, "auto", None, None), n)))
        call = sig(q, k, v, False, None, False, None, "auto", None, None)
        key2 = sig(q, k, v, False, None, False, None, "auto", None, None)[0]
        rows.append(("  last-key compare (a loop of one signature)",
                     _per_call(lambda: key2 == call[0], n)))
        rows.append(("  dict lookup (hash; another signature came between)",
                     _per_call(lambda: _callcache._CACHE.get(call[0]), n)))
        rec = _callcache._CACHE[call[0]]
        rows.append(("  tables' generation check", _per_call(lambda: rec.valid(), n)))
        rows.append(("  device check (runtime.getDevice)",
                     _per_call(lambda: cp.cuda.runtime.getDevice() == 0, n)))
        what = "CuPy's empty, host memory" if real else "stand-in empty"
        rows.append((f"  allocation of o before: empty(shape, dtype=<dtype>) ({what})",
                     _per_call(lambda: cp.empty(rec.o_shape, dtype=rec.dtype), n)))
        if hasattr(rec, "empty"):   # (a tree with the record's own empty: this branch on)
            o_dt = rec.o_dt
            rows.append((f"  allocation of o as the hit makes it, flag {'on' if FAST else 'off'}",
                         _per_call(lambda: rec.empty(rec.o_shape, o_dt), n)))
            if real is not None and not FAST:
                _callcache.FAST_EMPTY = True
                fast = _callcache._fast_empty(cp)
                _callcache.FAST_EMPTY = False
                rows.append(("  allocation of o with CUFLASH_FAST_EMPTY=1",
                             _per_call(lambda: fast(rec.o_shape, o_dt), n)))
                rows.append(("  (flag on: did the fast constructor resolve?)",
                             float(fast is not cp.empty)))
        decode = isinstance(rec, _callcache._DecodeRecord)
        if rec.part_bytes:
            rows.append((f"  allocation of the split partials ({rec.part_bytes} bytes)",
                         _per_call(lambda: cp.empty(rec.part_bytes, dtype=cp.uint8), n)))
        fmt, dt, full_dt = ((_callcache._DPTRS, _callcache._DECODE_V,
                             _decode.DECODE_PARAMS_DTYPE) if decode
                            else (_callcache._PTRS, _callcache._PARAMS_V, _launch.PARAMS_DTYPE))
        ptrs = (1, 2, 3, 4, 0, 0, 0)[:fmt.size // 8]
        tmpl = rec.template
        if rec.host_args is not None:
            mv = rec.host_mv
            rows.append(("  writing the pointers into the host block",
                         _per_call(lambda: fmt.pack_into(mv, 0, *ptrs), n)))
        rows.append(("  (other threads: a block per call, struct + frombuffer)",
                     _per_call(lambda: np.frombuffer(fmt.pack(*ptrs) + tmpl, dt)[0], n)))
        scalar = _CSCALAR
        if scalar is not None:   # what CuPy's kernel call does with the block (real CuPy)
            blk = np.frombuffer(fmt.pack(*ptrs) + tmpl, dt)[0]
            rows.append(("  (other threads: CuPy's CScalar copy of the block)",
                         _per_call(lambda: scalar(blk), n)))
        rows.append(("  record launch (pointers + no-op kernel)",
                     _per_call(lambda: rec.launch((1, 2, 3, 4, 0), None, 1 << 30), n)))
        for name, t in rows:
            print(f"  {name:55s} {t:8.2f} us")


if __name__ == "__main__":
    main()
