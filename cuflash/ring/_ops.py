"""The per-shard operations the ring schedule needs, for NumPy and for CuPy arrays: attention
on one (query half, key range) pair returning ``(o, lse)``, its backward with the *global*
``(o, lse)``, an accumulator that merges partial results, and casts.

Both go through cuflash's public functions (`cuflash.attention`, `cuflash.attention_backward`,
`cuflash.merge_states` or, on the GPU, the same merge kernel launched in place), so the ring
adds no attention arithmetic of its own.

Accumulators are float32 (float64 inputs are refused at the entry points): each shard result
is rounded once to the input dtype by the attention call, widened, and merged in float32; the
final result is rounded once to the input dtype.
"""
from __future__ import annotations

import numpy as np

import cuflash

ACC = np.float32


class NumPyOps:
    backend = "numpy"

    def __init__(self):
        self.xp = np

    def attention(self, q, k, v, *, causal, scale):
        return cuflash.attention(q, k, v, causal=causal, scale=scale, return_lse=True)

    def backward(self, do, q, k, v, o, lse, *, causal, scale):
        return cuflash.attention_backward(do, q, k, v, o, lse, causal=causal, scale=scale)

    def zeros(self, shape):
        return np.zeros(shape, dtype=ACC)

    def empty(self, shape, dtype):
        return np.empty(shape, dtype=dtype)

    def to_acc(self, x, out=None):
        if out is None:
            return x.astype(ACC)
        out[...] = x
        return out

    def add_into(self, dst, x):
        dst += x.astype(ACC, copy=False)

    def cast(self, x, dtype):
        return x.astype(dtype)

    def accumulator(self, shape):
        return _NumPyAccumulator(shape)


class _NumPyAccumulator:
    """A running (o, lse) in float32, starting from the merge's identity (o = 0, lse = -inf)."""

    def __init__(self, shape):
        self.o = np.zeros(shape, dtype=ACC)
        self.lse = np.full(shape[:-1], -np.inf, dtype=np.float32)

    def add(self, o, lse):
        self.o, self.lse = cuflash.merge_states(self.o, self.lse, o.astype(ACC), lse)


class CuPyOps:
    """GPU operations on the current device and stream (the transport's compute context)."""

    backend = "cupy"

    def __init__(self, device_id=None):
        import cupy

        self.xp = cupy
        self.device_id = cupy.cuda.Device().id if device_id is None else int(device_id)

    def attention(self, q, k, v, *, causal, scale):
        return cuflash.attention(q, k, v, causal=causal, scale=scale, return_lse=True)

    def backward(self, do, q, k, v, o, lse, *, causal, scale):
        return cuflash.attention_backward(do, q, k, v, o, lse, causal=causal, scale=scale)

    def zeros(self, shape):
        return self.xp.zeros(shape, dtype=ACC)

    def empty(self, shape, dtype):
        return self.xp.empty(shape, dtype=dtype)

    def to_acc(self, x, out=None):
        """x widened to float32 (into ``out`` when given); bfloat16 by its bits, since CuPy's
        elementwise kernels need not know ml_dtypes' bfloat16."""
        cp = self.xp
        if out is None:
            out = cp.empty(x.shape, dtype=ACC)
        if x.dtype.name == "bfloat16":
            bits = out.view(cp.uint32)
            cp.copyto(bits, x.view(cp.uint16))
            bits <<= 16
        else:
            cp.copyto(out, x)
        return out

    def add_into(self, dst, x):
        if x.dtype == ACC:
            dst += x
        else:
            dst += self.to_acc(x)

    def cast(self, x, dtype):
        """float32 -> ``dtype``, rounded to nearest even (bfloat16 by integer arithmetic)."""
        cp = self.xp
        dtype = np.dtype(dtype)
        if dtype.name != "bfloat16":
            return x.astype(dtype)
        x = cp.ascontiguousarray(x)
        u = x.view(cp.uint32)
        r = (u + (cp.uint32(0x7FFF) + ((u >> 16) & cp.uint32(1)))) >> 16
        r = cp.where(cp.isnan(x), cp.uint32(0x7FC0), r).astype(cp.uint16)
        return r.view(dtype)

    def accumulator(self, shape):
        return _CuPyAccumulator(self, shape)


class _CuPyAccumulator:
    """A running (o, lse) in float32 on the GPU, merged in place by cuflash's merge kernel:
    o is read and written by the same thread (safe in place); lse is read by every thread of a
    row and written by one, so it alternates between two buffers. The widened shard output
    reuses one buffer. Nothing is allocated per merge."""

    def __init__(self, ops, shape):
        from .. import _launch

        cp = ops.xp
        self._launch, self._dev = _launch, ops.device_id
        self._ops = ops
        self.o = cp.zeros(shape, dtype=ACC)
        self._lse = [cp.full(shape[:-1], -cp.inf, dtype=cp.float32) for _ in range(2)]
        self._cur = 0
        self._tmp = cp.empty(shape, dtype=ACC)

    @property
    def lse(self):
        return self._lse[self._cur]

    def add(self, o, lse):
        cp = self._ops.xp
        part = o if o.dtype == ACC and o.flags.c_contiguous else self._ops.to_acc(o, self._tmp)
        lse = cp.ascontiguousarray(lse)
        nxt = 1 - self._cur
        self._launch.launch_merge(self.o, self._lse[self._cur], part, lse, self.o, self._lse[nxt],
                                  "float32", self._dev, None)
        self._cur = nxt
