"""What a repeated `attention` call on GPU arrays has already established, kept by signature.

A forward call on GPU arrays spends most of its host time establishing things that depend only
on its *signature*: the checks of `_checks.check_attention`, the dispatcher's plan, the device's
limits, the batch-axis collapse and every field of the parameter block but the pointers. This
module keys those on everything they are computed from and, when the same signature comes
again, goes straight to the launch with the pointers of this call.

Why no check is dropped: the key holds, for q, k, v and the ``out`` buffers, the exact type
(plain ``cupy.ndarray``, or for q, k, v a plain ``torch.Tensor``; anything else takes the full
path), shape, strides, dtype, device and the data pointer's alignment modulo 16 bytes (for torch
tensors also ``requires_grad``, the negation and conjugation bits and the layout, which decide
whether DLPack export succeeds; and a torch hit needs torch's current stream to be the launch
stream, since the full path's DLPack import would order the launch after torch's stream), ``causal``, ``scale``, ``return_lse``, ``kernel`` and
``precision`` with their types, and the identity of the dispatcher's tables. Every check and
every dispatch decision is a function of those (the 16-byte alignment rules read ``ptr % 16`` and the strides; the
tensor-map API's availability is fixed per process; the stream is resolved on each call, as on
the full path). A signature is recorded only after its full-path call succeeded without copying
an input (no non-contiguous last axis, no unmergeable batch axes), so a hit repeats a call that
passed every check on identical metadata. The Hopper kernel's tensor maps hold the pointers
themselves: a hit with new pointers re-encodes them (`_launch.forward_params` on stand-ins with
the recorded layouts), a hit with the last pointers reuses them.

`cuflash.jax` keeps, per buffer-callback signature, the record its first call made, and
launches it with the pointers of XLA's buffers (`lookup`, `_Record.launch`).
"""
from __future__ import annotations

import copy
import struct
import sys
import types

import numpy as np

from . import _compile, _dispatch, _launch

#: AttnParams begins with the five pointers q, k, v, o, lse (8 bytes each): a hit writes them in
#: front of the recorded block's remaining bytes (a structured-scalar copy and field stores cost
#: about ten times more).
_PTRS = struct.Struct("<5Q")
assert [(_launch.PARAMS_DTYPE.fields[f][1]) for f in ("q", "k", "v", "o", "lse")] == \
    [0, 8, 16, 24, 32], "AttnParams must start with its five pointers"

#: Recorded signatures -> _Record; bounded (oldest dropped first).
_CACHE = {}
_CACHE_SIZE = 256


def _tables():
    """The dispatcher's tables as they are now: a record made under other tables (tests swap
    them with monkeypatch) must not be used. The record keeps them alive, so their ids stay
    unique while it exists."""
    d = _dispatch
    return (d.TC_CONFIGS, d.TC_ARCH_CONFIGS, d.TC_F32_CONFIGS, d.TC_F32_ARCH_CONFIGS,
            d.HOPPER_TABLE, d.HOPPER_F32_FORM, d.plan_for)


class _Layout:
    """What `_launch.forward_params` reads from an array (shape, strides, itemsize, pointer), for
    re-encoding the Hopper kernel's tensor maps with new pointers."""

    __slots__ = ("shape", "strides", "itemsize", "ndim", "data")

    def __init__(self, x, ptr=0):
        self.shape, self.strides = tuple(x.shape), tuple(x.strides)
        self.itemsize, self.ndim = x.itemsize, len(self.shape)
        self.data = types.SimpleNamespace(ptr=ptr)

    def at(self, ptr):
        y = copy.copy(self)
        y.data = types.SimpleNamespace(ptr=ptr)
        return y


class _Record:
    """What one signature established: the plan, the device limits, the parameter block without
    its pointers (or, for the Hopper kernel, the layouts its tensor maps are made from), the
    grid, the output shapes and dtype."""

    __slots__ = ("prob", "plan", "attrs", "template", "grid", "hopper", "tables", "o_shape",
                 "lse_shape", "dtype", "layouts", "last")

    def __init__(self, prob, plan, attrs, template, grid, arrays):
        self.prob, self.plan, self.attrs = prob, plan, attrs
        self.hopper = plan.spec.family == "attn_wgmma"
        # the block's bytes after the pointers (Hopper: the whole block, for the last pointers)
        self.template = template.tobytes()[_PTRS.size:]
        self.grid = grid
        self.tables = _tables()
        self.o_shape, self.lse_shape = prob.o_shape, prob.lse_shape
        self.dtype = arrays[0].dtype
        self.layouts = tuple(None if x is None else _Layout(x) for x in arrays)
        self.last = (tuple(0 if x is None else x.data.ptr for x in arrays), template)

    def valid(self):
        return all(a is b for a, b in zip(self.tables, _tables()))

    def launch(self, ptrs, stream):
        """Launch with the pointers (q, k, v, o, lse; lse 0 when not written) on `stream` (None,
        a CuPy stream, an object with .ptr/.cuda_stream, or an int handle). The caller has made
        the record's device current."""
        plan = self.plan
        if not self.hopper:
            params = np.frombuffer(_PTRS.pack(*ptrs) + self.template, _launch.PARAMS_DTYPE)[0]
        elif ptrs == self.last[0]:
            params = self.last[1]
        else:
            arrs = [lay if lay is None else lay.at(p) for lay, p in zip(self.layouts, ptrs)]
            q, k, v, o, lse = arrs
            prob = copy.copy(self.prob)
            prob.q, prob.k, prob.v = q, k, v
            params, _, _, _ = _launch.forward_params(plan, prob, q, k, v, o, lse, self.attrs)
            self.last = (tuple(ptrs), params)
        kern = _compile.get_kernel(plan.spec, self.prob.device_id, plan.smem_bytes)
        kern((self.grid,), (plan.threads,), (params,), shared_mem=plan.smem_bytes,
             stream=_launch._stream_ptr(stream))


def _arr_key(x, cp_ndarray, torch_tensor):
    t = type(x)
    if t is cp_ndarray:
        mem = x.data
        return (x.shape, x.strides, x.dtype, mem.device_id, mem.ptr & 15)
    if t is torch_tensor:
        return (t, x.shape, x.stride(), x.dtype, x.device, x.data_ptr() & 15, x.requires_grad,
                x.is_neg(), x.is_conj(), x.layout)
    raise LookupError


def _ptr(x):
    return x.data_ptr() if hasattr(x, "data_ptr") else x.data.ptr  # torch.Tensor, else CuPy


def signature(q, k, v, causal, scale, return_lse, out, kernel, precision):
    """The cache key of a call, or None when it cannot be cached (an argument that is neither a
    plain CuPy array nor a plain torch tensor, an unhashable argument)."""
    cp = sys.modules.get("cupy")
    if cp is None:
        return None
    nd = cp.ndarray
    torch = sys.modules.get("torch")
    tt = getattr(torch, "Tensor", None) if torch is not None else None
    try:
        # out: CuPy arrays only (the full path returns CuPy views of other types' buffers)
        if out is None:
            ok = None
        elif isinstance(out, (tuple, list)):
            ok = (type(out), len(out)) + tuple(_arr_key(b, nd, None) for b in out)
        else:
            ok = _arr_key(out, nd, None)
        key = (_arr_key(q, nd, tt), _arr_key(k, nd, tt), _arr_key(v, nd, tt), ok, type(causal),
               causal, type(scale), scale, type(return_lse), return_lse, type(kernel), kernel,
               type(precision), precision, tuple(map(id, _tables())))
        hash(key)
    except (LookupError, TypeError):
        return None
    return key


def record(key, prob, plan, attrs, o, lse):
    """Remember what the full path established for `key` (called after its launch)."""
    if key is None or prob.q is None:
        return
    try:
        template, grid, qkv, vparams = _launch.forward_params(plan, prob, prob.q, prob.k,
                                                              prob.v, o, lse, attrs)
    except Exception:  # nothing to remember
        return
    if vparams is not None:
        return  # variants (window, bias, ...) are not in the signature: always the full path
    if any(a is not b for a, b in zip(qkv, (prob.q, prob.k, prob.v))):
        return  # the launch needed copies: always take the full path for this signature
    rec_prob = copy.copy(prob)
    rec_prob.q = rec_prob.k = rec_prob.v = rec_prob.out = rec_prob.out_lse = None
    rec_prob.stream = None
    if len(_CACHE) >= _CACHE_SIZE:
        _CACHE.pop(next(iter(_CACHE)))
    _CACHE[key] = _Record(rec_prob, plan, attrs, template, grid, (prob.q, prob.k, prob.v, o, lse))


def lookup(key):
    """The valid record of `key`, or None."""
    rec = _CACHE.get(key)
    return rec if rec is not None and rec.valid() else None


def run(key, q, k, v, out, stream):
    """Launch a recorded signature with this call's buffers; None if `key` is not recorded."""
    rec = _CACHE.get(key)
    if rec is None:
        return None
    import cupy

    prob = rec.prob
    if out is None:
        o = lse = None
    elif isinstance(out, (tuple, list)):
        o, lse = out
    else:
        o, lse = out, None
    with cupy.cuda.Device(prob.device_id):
        launch_stream = _launch._stream_ptr(stream)
        if hasattr(q, "data_ptr") or hasattr(k, "data_ptr") or hasattr(v, "data_ptr"):
            # torch tensors: the full path's DLPack import makes the launch stream wait for
            # torch's current stream; skipping it is only right when they are the same stream.
            torch = sys.modules["torch"]
            if torch.cuda.current_stream(prob.device_id).cuda_stream != launch_stream.ptr:
                return None
        if o is None:
            o = cupy.empty(rec.o_shape, dtype=rec.dtype)
        if prob.return_lse and lse is None:
            lse = cupy.empty(rec.lse_shape, dtype=cupy.float32)
        rec.launch((_ptr(q), _ptr(k), _ptr(v), _ptr(o), 0 if lse is None else _ptr(lse)),
                   launch_stream)
    return (o, lse) if prob.return_lse else o


def clear():
    """Forget every recorded signature (tests; after changing dispatch tables at run time)."""
    _CACHE.clear()
