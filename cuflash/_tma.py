"""Tensor maps for the Hopper kernel's TMA loads, made on the host with the CUDA driver.

A tensor map (``CUtensorMap``, 128 opaque bytes) describes a tensor in global memory to the
tensor memory accelerator: base address, element type, sizes and byte strides of up to five
dimensions, the box one copy moves, and the shared-memory swizzle. ``cuTensorMapEncodeTiled``
builds it on the CPU (no device work, nothing to synchronise), so a map is made per call and
travels in the kernel's parameter block: a launch stays capturable in a CUDA graph.

The driver function is not part of CuPy's API, so it is called through ctypes on ``libcuda``,
which any process using CuPy on a GPU has loaded already.
"""
from __future__ import annotations

import ctypes
from typing import Optional, Sequence

#: CUtensorMapDataType values for the dtypes the Hopper kernel takes.
_DATA_TYPE = {"float16": 6, "bfloat16": 9, "float32": 7}
_SWIZZLE_128B = 3
_L2_PROMOTION_128B = 2
_INTERLEAVE_NONE = 0
_OOB_FILL_ZERO = 0
MAP_BYTES = 128

_lib = None
_error: Optional[str] = None


def _driver():
    global _lib, _error
    if _lib is None and _error is None:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
            fn = lib.cuTensorMapEncodeTiled
        except (OSError, AttributeError) as exc:
            _error = f"{type(exc).__name__}: {exc}"
            return None
        u32p, u64p = ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint64)
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, u64p,
                       u64p, u32p, u32p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
        fn.restype = ctypes.c_int
        lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        _lib = lib
    return _lib


def available() -> bool:
    return _driver() is not None


def unavailable_reason() -> str:
    _driver()
    return _error or ""


def encode_tiled(dtype_name: str, address: int, dims: Sequence[int], strides: Sequence[int],
                 box: Sequence[int]) -> bytes:
    """The 128-byte tensor map of a 16-bit or float32 tensor with 128-byte swizzled boxes.

    ``dims`` are sizes in elements, innermost (contiguous) first; ``strides`` the byte strides of
    dims[1:]; ``box`` the box size in elements per dim (box[0] * itemsize <= 128 for the swizzle).
    Elements of a box outside ``dims`` are read as zeros.
    """
    rank = len(dims)
    if not (len(strides) == rank - 1 and len(box) == rank):
        raise ValueError("tensor map: dims, strides and box disagree in rank")
    if any(s < 0 for s in strides):
        # ctypes would pass a negative stride as 2^64 - |s| (the driver's strides are unsigned)
        raise ValueError(f"tensor map: byte strides {list(strides)} must not be negative (an "
                         "axis that runs backwards has no tensor map; the dispatchers' "
                         "hopper_reason refuse such views)")
    lib = _driver()
    if lib is None:
        raise RuntimeError(f"cuTensorMapEncodeTiled is unavailable: {_error}")
    out = ctypes.create_string_buffer(MAP_BYTES + 64)
    # CUtensorMap is 64-byte aligned; the buffer is not necessarily.
    base = ctypes.addressof(out)
    aligned = (base + 63) & ~63
    status = lib.cuTensorMapEncodeTiled(
        ctypes.c_void_p(aligned), _DATA_TYPE[dtype_name], rank, ctypes.c_void_p(address),
        (ctypes.c_uint64 * rank)(*dims), (ctypes.c_uint64 * max(rank - 1, 1))(*strides),
        (ctypes.c_uint32 * rank)(*box), (ctypes.c_uint32 * rank)(*([1] * rank)),
        _INTERLEAVE_NONE, _SWIZZLE_128B, _L2_PROMOTION_128B, _OOB_FILL_ZERO)
    if status != 0:
        msg = ctypes.c_char_p()
        lib.cuGetErrorString(status, ctypes.byref(msg))
        raise ValueError(
            f"cuTensorMapEncodeTiled rejected the tensor (dims {list(dims)}, byte strides "
            f"{list(strides)}, box {list(box)}): {(msg.value or b'?').decode()} ({status})")
    return out.raw[aligned - base:aligned - base + MAP_BYTES]
