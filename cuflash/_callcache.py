"""What a repeated `attention` call on GPU arrays has already established, kept by signature.

A forward call on GPU arrays spends most of its host time establishing things that depend only
on its *signature*: the checks of `_checks.check_attention`, the dispatcher's plan, the device's
limits, the batch-axis collapse and every field of the parameter block but the pointers. This
module keys those on everything they are computed from and, when the same signature comes
again, goes straight to the launch with the pointers of this call. Both forward paths are kept:
the dense kernels (one launch) and the decode kernel (`_decode`: the split-KV kernel, and with
more than one split the combine, both reading one DecodeParams block; the split partials come
from CuPy's pool on the launch stream, as on the full path, or from the caller's ``workspace``).

Why no check is dropped: the key holds, for q, k, v, the ``out`` buffers and ``workspace``, the
exact type (plain ``cupy.ndarray``, or for q, k, v a plain ``torch.Tensor``; anything else takes
the full path), shape, strides, dtype, device and the data pointer's alignment (modulo 16 bytes;
the workspace's modulo WORKSPACE_ALIGN) (for torch tensors also ``requires_grad``, the negation
and conjugation bits and the layout, which decide whether DLPack export succeeds; and a torch
hit needs torch's current stream to be the launch stream, since the full path's DLPack import
would order the launch after torch's stream), ``causal``, ``scale``, ``return_lse``, ``kernel``
and ``precision`` with their types; a record is used only under the dispatcher's tables it
was made under (the decode thresholds and split rule included: `_tables`). Every check and
every dispatch decision is a function of those (the 16-byte alignment rules read ``ptr % 16`` and the strides; the workspace's size and
alignment rules its byte count and ``ptr % 256``; the tensor-map API's availability is fixed
per process; the stream is resolved on each call, as on the full path). A signature is recorded
only after its full-path call succeeded without copying an input (the checks' copy of a
non-contiguous last axis, the launch's copies of unmergeable batch axes: the kernels must read
the caller's own buffers), so a hit repeats a call that passed every check on identical
metadata. Grouped-query calls are kept too: the head split is a view whose strides follow from
the caller's, and a hit allocates the outputs in the caller's head layout (the same memory as
the full path's split outputs). The Hopper kernel's tensor maps hold the pointers themselves: a
hit with new pointers re-encodes them (`_launch.forward_params` on stand-ins with the recorded
layouts), a hit with the last pointers reuses them.

A hit does no device switch when the record's device is current, resolves the stream once,
allocates o (and lse) like the full path, packs the pointers in front of the recorded bytes of
the parameter block and calls the kernel objects kept in the record (notes/JAX.md "Host time").

`cuflash.jax` keeps, per buffer-callback signature, the record its first call made, and
launches it with the pointers of XLA's buffers (`lookup`, `launch`).
"""
from __future__ import annotations

import copy
import operator
import struct
import sys
import types

import numpy as np

from . import _compile, _decode, _dispatch, _launch

#: AttnParams begins with the five pointers q, k, v, o, lse (8 bytes each): a hit writes them in
#: front of the recorded block's remaining bytes (a structured-scalar copy and field stores cost
#: about ten times more).
_PTRS = struct.Struct("<5Q")
assert [(_launch.PARAMS_DTYPE.fields[f][1]) for f in ("q", "k", "v", "o", "lse")] == \
    [0, 8, 16, 24, 32], "AttnParams must start with its five pointers"
#: DecodeParams begins with q, k, v, o, lse, o_part, lse_part (then seqlens, block_table, cu_q,
#: cu_k, all 0 for dense `attention`, kept in the recorded bytes).
_DPTRS = struct.Struct(f"<{_decode.DECODE_PTRS_FIXED}Q")
assert [_decode.DECODE_PARAMS_DTYPE.fields[f][1] for f in _decode._DEC_PTRS[:7]] == \
    [8 * i for i in range(7)] and _decode._DEC_PTRS[:7] == (
        "q", "k", "v", "o", "lse", "o_part", "lse_part"), "DecodeParams must start so"

#: A hit passes its block to the kernel as a NumPy scalar of a plain (unstructured) void dtype
#: of the block's size: the same bytes, but CuPy's kernel-argument conversion (CScalar) copies
#: it about four times faster than a scalar of the 49-field structured dtype.
_PARAMS_V = np.dtype(f"V{_launch.PARAMS_DTYPE.itemsize}")
_DECODE_V = np.dtype(f"V{_decode.DECODE_PARAMS_DTYPE.itemsize}")
_HOPPER_V = np.dtype(f"V{_launch.HOPPER_PARAMS_DTYPE.itemsize}")
#: HopperParams holds the three tensor maps (made from q, k, v), then AttnParams' pointers.
_HOPPER_PTRS_AT = _launch.HOPPER_PARAMS_DTYPE.fields["q"][1]
assert [_launch.HOPPER_PARAMS_DTYPE.fields[f][1] - _HOPPER_PTRS_AT
        for f in ("q", "k", "v", "o", "lse")] == [0, 8, 16, 24, 32]

#: Recorded signatures -> _Record or _DecodeRecord; bounded (oldest dropped first).
_CACHE = {}
_CACHE_SIZE = 256


_DISPATCH_TABLES = operator.attrgetter(
    "TC_CONFIGS", "TC_ARCH_CONFIGS", "TC_F32_CONFIGS", "TC_F32_ARCH_CONFIGS", "HOPPER_TABLE",
    "HOPPER_F32_TABLE", "HOPPER_F32_AUTO", "HOPPER_F32_FORM", "HOPPER_F16SPLIT_TABLE",
    "TC_F32_FORM", "TC_F16SPLIT_CONFIGS",
    "HOPPER_LONG_SK", "HOPPER_C3_GAIN", "plan_for")
_DECODE_TABLES = operator.attrgetter(
    "DECODE_MAX_SQ", "DECODE_MAX_ROWS", "MIN_TILES_PER_WARP", "MAX_SPLITS", "choose_splits")


def _tables():
    """The dispatcher's tables (and the decode thresholds and split rule) as they are now. A
    record keeps the ones it was made under and is used only while they are still the same
    objects or equal to them (tuple comparison: identity first, so the usual case costs a few
    pointer compares); tests swap them with monkeypatch, and a record made under other tables
    then misses and is replaced."""
    return _DISPATCH_TABLES(_dispatch) + _DECODE_TABLES(_decode)


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


class _RecordBase:
    """What both kinds of record share: the outputs a hit allocates (the caller's shapes, also
    for grouped-query heads), the tables they were made under, the device."""

    __slots__ = ("plan", "device_id", "o_shape", "lse_shape", "dtype", "return_lse", "tables",
                 "part_bytes")

    def _base(self, prob, plan, pub_o, pub_lse):
        self.plan, self.device_id = plan, prob.device_id
        self.o_shape = tuple(pub_o.shape)
        self.lse_shape = None if pub_lse is None else tuple(pub_lse.shape)
        self.dtype = pub_o.dtype
        self.return_lse = prob.return_lse
        self.tables = _tables()
        self.part_bytes = 0   # workspace bytes a launch needs (decode kernel, split keys)

    def valid(self):
        return self.tables == _tables()


class _Record(_RecordBase):
    """A dense-kernel signature: the plan, the device limits, the parameter block without its
    pointers (or, for the Hopper kernel, the layouts its tensor maps are made from), the grid,
    the kernel object."""

    __slots__ = ("prob", "attrs", "template", "grid", "hopper", "layouts", "last", "kern")

    def __init__(self, prob, plan, attrs, template, grid, arrays, pub_o, pub_lse):
        self._base(prob, plan, pub_o, pub_lse)
        self.prob, self.attrs = prob, attrs
        self.hopper = plan.spec.family == "attn_wgmma"
        # the block's bytes after the pointers (Hopper: the whole block, for the last pointers)
        self.template = template.tobytes()[_PTRS.size:]
        assert self.hopper or template.dtype == _launch.PARAMS_DTYPE
        self.grid = grid
        self.layouts = tuple(None if x is None else _Layout(x) for x in arrays)
        # Hopper: the q, k, v pointers the last block's tensor maps were made from, its bytes
        self.last = (tuple(x.data.ptr for x in arrays[:3]), template.tobytes())
        self.kern = _compile.get_kernel(plan.spec, prob.device_id, plan.smem_bytes)

    def launch(self, ptrs, stream, parts=0):
        """Launch with the pointers (q, k, v, o, lse; lse 0 when not written) on `stream` (a
        CuPy stream object: `_launch._stream_ptr`). The caller has made the record's device
        current. `parts` is unused (the dense kernels need no workspace)."""
        plan = self.plan
        if not self.hopper:
            params = np.frombuffer(_PTRS.pack(*ptrs) + self.template, _PARAMS_V)[0]
        else:
            if tuple(ptrs[:3]) != self.last[0]:   # new inputs: new tensor maps
                arrs = [lay if lay is None else lay.at(p) for lay, p in zip(self.layouts, ptrs)]
                q, k, v, o, lse = arrs
                prob = copy.copy(self.prob)
                prob.q, prob.k, prob.v = q, k, v
                full, _, _, _ = _launch.forward_params(plan, prob, q, k, v, o, lse, self.attrs)
                self.last = (tuple(ptrs[:3]), full.tobytes())
            b = self.last[1]   # the maps of these inputs; o and lse written in
            params = np.frombuffer(b[:_HOPPER_PTRS_AT] + _PTRS.pack(*ptrs)
                                   + b[_HOPPER_PTRS_AT + _PTRS.size:], _HOPPER_V)[0]
        self.kern((self.grid,), (plan.threads,), (params,), shared_mem=plan.smem_bytes,
                  stream=stream)


class _DecodeRecord(_RecordBase):
    """A decode-kernel signature (`_decode.launch_dense`): the DecodeParams bytes after the
    seven per-call pointers, the configuration (grid, splits, the partials' layout in the
    workspace) and both kernel objects (the combine only with more than one split)."""

    __slots__ = ("template", "grid", "threads", "smem", "kern", "comb", "comb_grid",
                 "o_part_bytes", "splits", "label")

    def __init__(self, prob, plan, attrs, o, lse, pub_o, pub_lse):
        self._base(prob, plan, pub_o, pub_lse)
        geom, cfg = _decode.dense_config(plan, prob, o, lse, attrs)
        fake = types.SimpleNamespace(nbytes=cfg.part_bytes, data=types.SimpleNamespace(ptr=0))
        params = _decode.decode_params(plan, geom, prob.q, prob.k, prob.v, o, lse,
                                       scale=prob.scale, cfg=cfg, parts=fake)
        self.template = params.tobytes()[_DPTRS.size:]
        self.grid, self.threads, self.smem = cfg.grid, plan.threads, plan.smem_bytes
        self.splits, self.part_bytes, self.o_part_bytes = cfg.splits, cfg.part_bytes, \
            cfg.o_part_bytes
        self.kern = _compile.get_kernel(plan.spec, prob.device_id, plan.smem_bytes)
        self.comb = None
        if cfg.splits > 1:
            self.comb = _compile.get_kernel(
                _decode.combine_spec(_decode._dtype_of(plan), cfg.dpad), prob.device_id)
            self.comb_grid = cfg.entries * cfg.rows
        self.label = plan.label

    def launch(self, ptrs, stream, parts=0):
        """Launch with the pointers (q, k, v, o, lse) on `stream` (a CuPy stream object);
        `parts`: the device address of at least ``part_bytes`` bytes of workspace,
        WORKSPACE_ALIGN-aligned, that nothing else uses until both kernels have run in
        `stream`'s order (0 when ``part_bytes`` is 0)."""
        if self.comb is None:
            params = np.frombuffer(_DPTRS.pack(*ptrs, 0, 0) + self.template, _DECODE_V)[0]
            self.kern((self.grid,), (self.threads,), (params,), shared_mem=self.smem,
                      stream=stream)
            return
        if not parts:
            raise ValueError(f"{self.label}: the split partials need {self.part_bytes} bytes")
        params = np.frombuffer(_DPTRS.pack(*ptrs, parts, parts + self.o_part_bytes)
                               + self.template, _DECODE_V)[0]
        self.kern((self.grid,), (self.threads,), (params,), shared_mem=self.smem, stream=stream)
        self.comb((self.comb_grid,), (_decode.COMBINE_THREADS,), (params,), stream=stream)


def _arr_key(x, cp_ndarray, torch_tensor, ptrs):
    """The key of one array (appending its data pointer to `ptrs`), LookupError for any other
    type."""
    t = type(x)
    if t is cp_ndarray:
        mem = x.data
        p = mem.ptr
        ptrs.append(p)
        return (x.shape, x.strides, x.dtype, mem.device_id, p & 15)
    if t is torch_tensor:
        p = x.data_ptr()
        ptrs.append(p)
        return (t, x.shape, x.stride(), x.dtype, x.get_device(), p & 15, x.requires_grad,
                x.is_neg(), x.is_conj(), x.layout)
    raise LookupError


class Call:
    """What `signature_of` established about one call: the key, the data pointers of q, k, v,
    and whether any of them is a torch tensor."""

    __slots__ = ("key", "ptrs", "torch")

    def __init__(self, key, ptrs, torch):
        self.key, self.ptrs, self.torch = key, ptrs, torch


def signature_of(q, k, v, causal, scale, return_lse, out, kernel, precision, workspace=None):
    """The `Call` of these arguments, or None when it cannot be cached (an array argument that
    is neither a plain CuPy array nor a plain torch tensor; CuPy only for out and workspace).
    A key holding an unhashable argument is never recorded (`record`) nor found (`_get`)."""
    cp = sys.modules.get("cupy")
    if cp is None:
        return None
    nd = cp.ndarray
    torch = sys.modules.get("torch")
    tt = getattr(torch, "Tensor", None) if torch is not None else None
    ptrs = []
    try:
        key = (_arr_key(q, nd, tt, ptrs), _arr_key(k, nd, tt, ptrs), _arr_key(v, nd, tt, ptrs))
        is_torch = type(q) is tt or type(k) is tt or type(v) is tt
        # out and workspace: CuPy arrays only (the full path returns CuPy views of other
        # types' buffers); their pointers are read again on a hit
        more = []
        if out is None:
            ok = None
        elif isinstance(out, (tuple, list)):
            ok = (type(out), len(out)) + tuple(_arr_key(b, nd, None, more) for b in out)
        else:
            ok = _arr_key(out, nd, None, more)
        if workspace is None:
            wk = None
        else:
            wk = _arr_key(workspace, nd, None, more) + (
                workspace.data.ptr % _launch.WORKSPACE_ALIGN,)
        key += (ok, wk, type(causal), causal, type(scale), scale, type(return_lse), return_lse,
                type(kernel), kernel, type(precision), precision)
    except LookupError:
        return None
    # (an unhashable argument, e.g. a list as scale, raises TypeError at the first lookup:
    # `_get` treats it as not recorded, `record` never records it; hashing here too would
    # hash every key twice)
    return Call(key, ptrs, is_torch)


def signature(q, k, v, causal, scale, return_lse, out, kernel, precision, workspace=None):
    """The cache key of a call (`signature_of`), or None."""
    call = signature_of(q, k, v, causal, scale, return_lse, out, kernel, precision, workspace)
    return None if call is None else call.key


def record(call, prob, plan, attrs, o, lse, pub_o, pub_lse):
    """Remember what the full path established for `call` (a `Call`; after its launch): `o`,
    `lse` the buffers the kernels wrote (grouped-query heads split), `pub_o`, `pub_lse` what
    the call returned."""
    if call is None or prob.q is None or getattr(prob, "variant", None) is not None:
        return
    try:
        hash(call.key)
    except TypeError:
        return
    if [x.data.ptr for x in (prob.q, prob.k, prob.v)] != call.ptrs:
        return  # the checks copied an input: the kernels must read the caller's buffers
    if plan.spec.family == "attn_decode":
        try:
            rec = _DecodeRecord(prob, plan, attrs, o, lse, pub_o, pub_lse)
        except Exception:  # nothing to remember
            return
    else:
        try:
            template, grid, qkv, vparams = _launch.forward_params(plan, prob, prob.q, prob.k,
                                                                  prob.v, o, lse, attrs)
        except Exception:  # nothing to remember
            return
        if vparams is not None:
            return  # variants (window, bias, ...) are not in the signature: the full path
        if any(a is not b for a, b in zip(qkv, (prob.q, prob.k, prob.v))):
            return  # the launch needed copies: always take the full path for this signature
        rec_prob = copy.copy(prob)
        rec_prob.q = rec_prob.k = rec_prob.v = rec_prob.out = rec_prob.out_lse = None
        rec_prob.stream = rec_prob.workspace = rec_prob.out_public = None
        rec = _Record(rec_prob, plan, attrs, template, grid, (prob.q, prob.k, prob.v, o, lse),
                      pub_o, pub_lse)
    if len(_CACHE) >= _CACHE_SIZE:
        _CACHE.pop(next(iter(_CACHE)))
    _CACHE[call.key] = rec


def _get(key):
    """The record of `key`, or None (also for an unhashable key)."""
    try:
        return _CACHE.get(key)
    except TypeError:
        return None


def lookup(key):
    """The valid record of `key`, or None."""
    rec = _get(key)
    return rec if rec is not None and rec.valid() else None


def _torch_stream(torch, device_id):
    """torch's current stream on `device_id` as a raw handle (the cheap accessor where this
    torch has it)."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return raw(device_id)
    return torch.cuda.current_stream(device_id).cuda_stream


def launch(rec, ptrs, stream, workspace=None, current=False):
    """Launch record `rec` with the pointers (q, k, v, o, lse) on `stream` (a CuPy stream
    object) on the record's (current) device. The decode kernel's split partials go to
    `workspace` (a CuPy array the caller owns) or, without one, to a CuPy pool block allocated
    with `stream` current (`current`: it already is), as on the full path (`_decode.scratch`):
    the pool hands a block freed by this call on only to later work in `stream`'s order."""
    if not rec.part_bytes:
        rec.launch(ptrs, stream)
        return
    if workspace is not None:
        rec.launch(ptrs, stream, workspace.data.ptr)
        return
    cp = sys.modules["cupy"]
    if current:
        parts = cp.empty(rec.part_bytes, dtype=cp.uint8)
    else:
        with stream:
            parts = cp.empty(rec.part_bytes, dtype=cp.uint8)
    rec.launch(ptrs, stream, parts.data.ptr)
    del parts  # back to the pool, for `stream`'s later work only


def run(call, out, workspace, stream):
    """Launch a recorded signature with this call's buffers; None if `call` is not recorded
    (or, for torch tensors, torch's current stream is not the launch stream)."""
    rec = _get(call.key)
    if rec is None or rec.tables != _tables():   # (other tables: the full path re-records)
        return None
    cp = sys.modules["cupy"]
    dev = rec.device_id
    if cp.cuda.runtime.getDevice() == dev:  # a Device context costs more than the check
        return _hit(cp, rec, call, out, workspace, stream)
    with cp.cuda.Device(dev):
        return _hit(cp, rec, call, out, workspace, stream)


def _hit(cp, rec, call, out, workspace, stream):
    current = stream is None
    st = cp.cuda.get_current_stream() if current else _launch._stream_ptr(stream)
    if call.torch and _torch_stream(sys.modules["torch"], rec.device_id) != st.ptr:
        # the full path's DLPack import makes the launch stream wait for torch's current
        # stream; skipping it is only right when they are the same stream.
        return None
    if out is None:
        o = cp.empty(rec.o_shape, dtype=rec.dtype)
        lse = None
    elif isinstance(out, (tuple, list)):
        o, lse = out
    else:
        o, lse = out, None   # (with return_lse=True: lse allocated, as on the full path)
    if rec.return_lse and lse is None:
        lse = cp.empty(rec.lse_shape, dtype=cp.float32)
    q, k, v = call.ptrs
    ptrs = (q, k, v, o.data.ptr, 0 if lse is None else lse.data.ptr)
    if rec.part_bytes:
        launch(rec, ptrs, st, workspace, current)
    else:
        rec.launch(ptrs, st)
    return (o, lse) if rec.return_lse else o


def clear():
    """Forget every recorded signature (tests; after changing dispatch tables at run time)."""
    _CACHE.clear()
