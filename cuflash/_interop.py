"""Where an array lives, and zero-copy views of foreign GPU arrays as CuPy arrays.

Accepted inputs:

- NumPy arrays (and CPU objects exposing ``__dlpack__``, viewed through ``numpy.from_dlpack``):
  the NumPy path.
- CuPy arrays, used as they are.
- Any GPU array exposing ``__cuda_array_interface__`` (Numba, PyTorch) or ``__dlpack__`` with a CUDA
  device (PyTorch, JAX): viewed as a CuPy array without a copy.

CuPy is imported lazily so that ``import cuflash`` works without it.
"""
from __future__ import annotations

import numpy as np

_KDLCPU = 1
_KDLCUDA = 2
_KDLCUDA_MANAGED = 13


def cupy_or_none():
    try:
        import cupy
    except Exception:  # ImportError, or a CuPy that fails to load its CUDA libraries
        return None
    return cupy


def backend_of(x, name):
    """Return ("cpu", None) or ("gpu", device_id) for an array argument; TypeError otherwise.

    DLPack is preferred to ``__cuda_array_interface__`` when an object has both (PyTorch): only
    DLPack carries a bfloat16 type code.
    """
    if isinstance(x, np.ndarray):
        return "cpu", None
    cp = cupy_or_none()
    if cp is not None and isinstance(x, cp.ndarray):
        return "gpu", x.device.id
    dev = getattr(x, "__dlpack_device__", None)
    if dev is not None and hasattr(x, "__dlpack__"):
        kind, dev_id = dev()
        if int(kind) == _KDLCPU:
            return "cpu", None
        if int(kind) in (_KDLCUDA, _KDLCUDA_MANAGED):
            if cp is None:
                raise TypeError(f"{name} is a GPU array, but CuPy is not installed: "
                                "install cuflash[cuda13] or cuflash[cuda12]")
            return "gpu", int(dev_id)
        raise TypeError(f"{name} lives on DLPack device type {int(kind)}; only CPU and CUDA "
                        "arrays are supported")
    if getattr(x, "__cuda_array_interface__", None) is not None:
        if cp is None:
            raise TypeError(f"{name} is a GPU array, but CuPy is not installed: "
                            "install cuflash[cuda13] or cuflash[cuda12]")
        return "gpu", cp.asarray(x).device.id
    raise TypeError(f"{name} must be a NumPy or CuPy array, or a GPU array exposing DLPack or "
                    f"__cuda_array_interface__; got {type(x).__module__}.{type(x).__name__}")


def _register_bfloat16():
    """Import ml_dtypes if it is installed: it registers bfloat16 with NumPy, which CuPy and
    NumPy need to give DLPack bfloat16 tensors (PyTorch, JAX) a bfloat16 dtype."""
    try:
        import ml_dtypes  # noqa: F401
    except ImportError:
        pass


def as_backend_array(x, backend):
    """View `x` as a NumPy (cpu) or CuPy (gpu) array; never copies."""
    _register_bfloat16()
    if backend == "cpu":
        return x if isinstance(x, np.ndarray) else np.from_dlpack(x)
    cp = cupy_or_none()
    if isinstance(x, cp.ndarray):
        return x
    if hasattr(x, "__dlpack__"):
        return cp.from_dlpack(x)
    return cp.asarray(x)  # __cuda_array_interface__


def describe(backend, device_id):
    return "the CPU (NumPy)" if backend == "cpu" else f"GPU {device_id}"


def last_axis_contiguous(x):
    """`x` itself if its last axis is contiguous (or has length 1), else a copy that is."""
    if x.shape[-1] == 1 or x.strides[-1] == x.itemsize:
        return x
    cp = cupy_or_none()
    return cp.ascontiguousarray(x)
