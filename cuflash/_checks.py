"""Argument checking for the public API, in one place and before any launch.

`check_attention` turns whatever the caller passed into a `Problem`: arrays on one backend (NumPy or
CuPy), one dtype, validated shapes, the softmax scale, the output buffers and the stream. Every
error names the argument and says what was expected. Nothing here launches work on the GPU or
synchronises it; the only copies are the documented ones (an input whose last axis is not
contiguous, see `attention`'s docstring).
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any, Optional, Tuple

import numpy as np

from . import _gqa, _interop

#: Largest head dimension (D and Dv) any kernel accepts.
MAX_HEAD_DIM = 256

#: dtypes accepted by `attention`, by NumPy/CuPy dtype name.
SUPPORTED_DTYPES = ("float16", "bfloat16", "float32", "float64")

KERNEL_CHOICES = ("auto", "generic", "tensorcore", "hopper", "decode")

#: Values of `precision=` (case-insensitive; JAX's `jax.lax.Precision` members are accepted by name).
#: "default" is "highest": float32 inputs get float32-accurate products unless "high" is asked for.
PRECISION_CHOICES = ("default", "highest", "high")


@dataclass
class Problem:
    """A validated attention call. Shapes follow the public API: q (..., Sq, D), k (..., Sk, D),
    v (..., Sk, Dv), o (..., Sq, Dv), lse (..., Sq) with ``...`` = ``batch_shape``."""

    backend: str                 # "cpu" or "gpu"
    q: Any
    k: Any
    v: Any
    dtype_name: str
    batch_shape: Tuple[int, ...]
    sq: int
    sk: int
    d: int
    dv: int
    causal: bool
    scale: float
    return_lse: bool
    out: Any                     # None or the o buffer to write
    out_lse: Any                 # None or the lse buffer to write
    stream: Any                  # None (current stream) or a cupy.cuda.Stream-like object
    kernel: str
    device_id: Optional[int] = None
    precision: str = "highest"   # "highest" or "high" (see check_precision)
    # Grouped-query heads (cuflash/_gqa.py): None, or the head split applied to q, k, v, out and
    # lse, whose ``batch_shape`` is then the split one; `public` undoes it on results.
    gqa: Optional[_gqa.Grouping] = None
    out_public: Any = None       # the caller's out (o or (o, lse)) when gqa split it
    variant: Any = None          # None (plain) or a cuflash.variants.Variant (see check_variant)
    workspace: Any = None        # None or a GPU byte buffer (check_workspace): scratch memory

    @property
    def o_shape(self):
        return self.batch_shape + (self.sq, self.dv)

    @property
    def lse_shape(self):
        return self.batch_shape + (self.sq,)


@dataclass
class BackwardProblem(Problem):
    """A validated `attention_backward` call: the forward's `Problem` (q, k, v, shapes, mask,
    scale, kernel, stream; ``return_lse``, ``out`` and ``out_lse`` unused) plus o, do (..., Sq, Dv)
    and lse (..., Sq) with ``...`` = ``batch_shape``, and the gradient buffers."""

    o: Any = None
    do: Any = None
    lse: Any = None                # float32
    deterministic: bool = False
    out_grads: Any = None          # None or (dq, dk, dv) buffers with q's, k's, v's shapes
    grad_shapes_public: Any = None  # the caller's q, k, v shapes (before a gqa split)
    return_dbias: bool = False     # also compute dbias (needs variant.bias)

    @property
    def grad_shapes(self):
        return tuple(tuple(x.shape) for x in (self.q, self.k, self.v))


def dtype_name(dtype) -> str:
    """Canonical name of a NumPy/CuPy dtype ('float16', 'bfloat16', ...)."""
    return np.dtype(dtype).name


def _check_array_dtype(name, x):
    n = dtype_name(x.dtype)
    if n not in SUPPORTED_DTYPES and x.dtype.kind == "V" and x.dtype.itemsize == 2:
        # ml_dtypes' bfloat16 is itself kind "V" but is named "bfloat16" and passed above.
        raise TypeError(f"{name} has an opaque 2-byte dtype ({x.dtype}), as a bfloat16 tensor gets "
                        "when it arrives without ml_dtypes (which gives NumPy and CuPy their "
                        "bfloat16 dtype) or through __cuda_array_interface__, which has no "
                        "bfloat16 type code; install ml_dtypes, or pass the tensor through DLPack")
    if n not in SUPPORTED_DTYPES:
        raise TypeError(
            f"{name} has dtype {n}; expected one of {', '.join(SUPPORTED_DTYPES)}")
    return n


def check_scale(scale, d, dtype="float64"):
    """The softmax scale as a Python float; defaults to 1/sqrt(D).

    It must be finite and usable in the compute dtype of ``dtype`` (float32 for float16,
    bfloat16 and float32 inputs, float64 for float64): the kernels fold ``scale * log2(e)`` into
    one multiplication, so that product must be a finite normal number there (or the scale 0).
    """
    if scale is None:
        return 1.0 / math.sqrt(d)
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a real number or None, got {type(scale).__name__}")
    try:
        scale = float(scale)
    except OverflowError:
        raise ValueError(f"scale must be finite, got {scale!r}, which overflows a float") from None
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    compute = np.finfo(np.float64 if dtype == "float64" else np.float32)
    folded = abs(scale) * math.log2(math.e)
    if scale != 0 and not float(compute.tiny) <= folded <= float(compute.max):
        raise ValueError(
            f"scale={scale!r} is not usable with {dtype} inputs: scale * log2(e) must lie within "
            f"the normal range of the {compute.dtype} computation "
            f"[{float(compute.tiny):.3g}, {float(compute.max):.3g}] (or scale be 0)")
    return scale


def check_precision(precision) -> str:
    """The float32 product mode of `precision=`: "highest" (also for None and "default") or "high".

    Accepts the strings of PRECISION_CHOICES in any case and objects with such a ``name``
    (``jax.lax.Precision.HIGHEST``); anything else raises, naming what is accepted.
    """
    if precision is None:
        return "highest"
    name = precision if isinstance(precision, str) else getattr(precision, "name", None)
    if not isinstance(name, str) or name.lower() not in PRECISION_CHOICES:
        raise ValueError(f"precision must be one of {PRECISION_CHOICES} (or None), got "
                         f"{precision!r}")
    name = name.lower()
    return "highest" if name == "default" else name


def _check_kernel(kernel, backend,
                  where="the inputs are on the CPU (NumPy); pass GPU arrays or kernel='auto'"):
    """`kernel` must be one of KERNEL_CHOICES, and "auto" where `backend` is "cpu" (`where`: why
    the call runs on the CPU, for the message)."""
    if kernel not in KERNEL_CHOICES:
        raise ValueError(f"kernel must be one of {KERNEL_CHOICES}, got {kernel!r}")
    if backend == "cpu" and kernel != "auto":
        raise ValueError(f"kernel={kernel!r} selects a GPU kernel, but {where}")


def _check_out(name, buf, shape, dtype, backend, device_id, check_dtype_name=None):
    if buf is None:
        return None
    _refuse_subclass(name, buf)
    b_backend, b_dev = _interop.backend_of(buf, name)
    if b_backend != backend or (backend == "gpu" and b_dev != device_id):
        raise ValueError(
            f"{name} is on {_interop.describe(b_backend, b_dev)} but the inputs are on "
            f"{_interop.describe(backend, device_id)}")
    buf = _interop.as_backend_array(buf, b_backend)
    if tuple(buf.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(buf.shape)}; expected {tuple(shape)}")
    want = check_dtype_name or dtype
    if dtype_name(buf.dtype) != want:
        raise TypeError(f"{name} has dtype {dtype_name(buf.dtype)}; expected {want}")
    if buf.ndim and buf.shape[-1] > 1 and buf.strides[-1] != buf.itemsize:
        raise ValueError(f"{name} must have a contiguous last axis (stride {buf.itemsize} "
                         f"bytes), got stride {buf.strides[-1]}")
    if backend == "cpu" and not buf.flags.writeable:
        raise ValueError(f"{name} is read-only")
    return _no_self_overlap(name, buf)


def _data_ptr(x):
    """The address of element 0 of a NumPy or CuPy(-like) array."""
    return x.ctypes.data if isinstance(x, np.ndarray) else x.data.ptr


def byte_span(x):
    """``(lo, hi)``: the bytes ``[lo, hi)`` that the elements of array `x` lie within (any
    strides, negative ones included; an empty array spans nothing)."""
    lo = hi = _data_ptr(x)
    if 0 in x.shape:
        return lo, lo
    for n, st in zip(x.shape, x.strides):
        if st > 0:
            hi += (n - 1) * st
        else:
            lo += (n - 1) * st
    return lo, hi + x.itemsize


def span_offsets(x):
    """`byte_span` of `x` relative to its address: what a call cache keeps of a recorded
    layout, so that a hit tests `spans_meet` with the new addresses only."""
    p = _data_ptr(x)
    lo, hi = byte_span(x)
    return lo - p, hi - p


def spans_meet(pa, offs_a, pb, offs_b):
    """Whether arrays at addresses `pa`, `pb` with `span_offsets` `offs_a`, `offs_b` have
    intersecting byte spans."""
    return pa + offs_a[0] < pb + offs_b[1] and pb + offs_b[0] < pa + offs_a[1]


def spans_overlap(a, b):
    """Whether the byte spans of arrays `a` and `b` (`byte_span`) intersect: necessary for them
    to share an element, cheap (the call caches' test; `overlap` decides exactly)."""
    alo, ahi = byte_span(a)
    blo, bhi = byte_span(b)
    return alo < bhi and blo < ahi


class _Layout:
    """A NumPy array interface of another array's address, shape and strides: lets
    `numpy.shares_memory` compare the layouts of GPU arrays without touching their memory."""

    def __init__(self, x):
        self.__array_interface__ = {"shape": tuple(int(n) for n in x.shape),
                                    "strides": tuple(int(s) for s in x.strides),
                                    "typestr": f"|V{x.itemsize}", "data": (_data_ptr(x), False),
                                    "version": 3}


def overlap(a, b) -> bool:
    """Whether arrays `a` and `b` (NumPy, or GPU arrays with ``data.ptr``; on one device) have
    an element in common. Exact where NumPy's overlap solver decides within a bounded effort
    (any layout the API meets), else answered by the byte spans (`spans_overlap`)."""
    if not spans_overlap(a, b):
        return False
    if not (isinstance(a, np.ndarray) and isinstance(b, np.ndarray)):
        a, b = np.asarray(_Layout(a)), np.asarray(_Layout(b))
    try:
        return bool(np.shares_memory(a, b, max_work=10**5))
    except getattr(np, "exceptions", np).TooHardError:   # (np.TooHardError before NumPy 1.25)
        return True


def no_overlap(named):
    """Raise ValueError when two of the buffers a call writes share memory: `named` is a list of
    ``(name, array or None)``; each element of an output is written once, by one output."""
    bufs = [(n, x) for n, x in named if x is not None]
    for i, (na, a) in enumerate(bufs):
        for nb, b in bufs[i + 1:]:
            if overlap(a, b):
                raise ValueError(f"{na} and {nb} overlap in memory; pass output buffers that "
                                 "share no element")


def _refuse_subclass(name, x):
    """NumPy subclasses (masked arrays, np.matrix) would lose their meaning or break indexing
    inside the CPU path: refuse them up front, naming the argument."""
    if isinstance(x, np.ndarray) and type(x) is not np.ndarray:
        kind = f"{type(x).__module__}.{type(x).__name__}"
        hint = (" (its mask would be ignored: fill or drop the masked entries, then pass "
                "np.asarray of the result)" if isinstance(x, np.ma.MaskedArray) else
                " (pass np.asarray of it)")
        raise TypeError(f"{name} is a {kind}, a subclass of numpy.ndarray; expected a plain "
                        f"numpy.ndarray{hint}")


def _check_qkv(q, k, v):
    """The checks `attention` and `attention_backward` share on q, k, v: one backend and device,
    at least 2 dimensions, no zero-length axis, one supported dtype, matching D and Sk, head dims
    at most MAX_HEAD_DIM, broadcastable batch axes.

    Returns (backend, device_id, q, k, v as backend arrays, dtype name, batch shape, sq, sk, d, dv).
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        _refuse_subclass(name, x)
    backends = [_interop.backend_of(x, n) for x, n in ((q, "q"), (k, "k"), (v, "v"))]
    if len(set(backends)) != 1:
        desc = ", ".join(f"{n} on {_interop.describe(*b)}" for n, b in zip("qkv", backends))
        raise ValueError(f"q, k and v must be on the same device; got {desc}")
    backend, device_id = backends[0]
    q, k, v = (_interop.as_backend_array(x, backend) for x in (q, k, v))

    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim < 2:
            raise ValueError(
                f"{name} must have at least 2 dimensions (..., S, D); got shape {tuple(x.shape)}")
        if 0 in x.shape:
            raise ValueError(f"{name} has a zero-length axis: shape {tuple(x.shape)}")
    names = [_check_array_dtype(n, x) for n, x in (("q", q), ("k", k), ("v", v))]
    if len(set(names)) != 1:
        raise TypeError(f"q, k and v must have the same dtype; got {names[0]}, {names[1]}, {names[2]}")
    dt = names[0]
    # Grouped-query heads become a broadcast over a split head axis (views; _gqa.py).
    _, q, k, v = _gqa.split_all(q, k, v)

    sq, d = q.shape[-2:]
    sk, dk = k.shape[-2:]
    skv, dv = v.shape[-2:]
    if dk != d:
        raise ValueError(f"k has head dim {dk} but q has {d}: the last axes of q and k must match")
    if skv != sk:
        raise ValueError(f"v has {skv} keys (axis -2) but k has {sk}: they must match")
    for name, n in (("head dim D of q and k", d), ("head dim Dv of v", dv)):
        if n > MAX_HEAD_DIM:
            raise ValueError(f"{name} is {n}; at most {MAX_HEAD_DIM} is supported")
    try:
        batch = tuple(int(s) for s in np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2]))
    except ValueError:
        raise ValueError(
            f"the batch axes of q {tuple(q.shape[:-2])}, k {tuple(k.shape[:-2])} and "
            f"v {tuple(v.shape[:-2])} do not broadcast") from None
    return backend, device_id, q, k, v, dt, batch, int(sq), int(sk), int(d), int(dv)


def check_variant(variant, backend, device_id, batch, sq, sk):
    """The variant keyword arguments (a dict of ``window``, ``softcap``, ``alibi_slopes``,
    ``bias``, ``mask``; None or empty: plain) as a `cuflash.variants.Variant`, or None when
    plain. Errors name the argument (see `cuflash.variants.variant_from_kwargs`)."""
    if not variant:
        return None
    from .variants import VARIANT_ARGS, variant_from_kwargs

    bad = sorted(set(variant) - set(VARIANT_ARGS))
    if bad:
        raise TypeError(f"unexpected keyword argument(s) {', '.join(bad)}")
    var = variant_from_kwargs(**variant, backend=backend, device_id=device_id, batch=batch,
                              sq=sq, sk=sk)
    if var.has_mods and backend != "cpu":   # user hooks: their CUDA code compiles (once)
        from .mods import check_compiles
        check_compiles(var.score_mod, var.mask_mod)
    return None if var.is_plain else var


def check_packed_heads(k_name, v_name, h, hkv, d, dk, dv):
    """Head dims and head counts of the packed (..., H, D) entry points (attention_with_kvcache,
    attention_varlen): k's D equals q's, D and Dv within MAX_HEAD_DIM, H a multiple of Hkv."""
    if dk != d:
        raise ValueError(f"{k_name} has head dim {dk} but q has {d}")
    for what, n in (("head dim D", d), (f"head dim Dv of {v_name}", dv)):
        if n > MAX_HEAD_DIM:
            raise ValueError(f"{what} is {n}; at most {MAX_HEAD_DIM} is supported")
    if h % hkv:
        raise ValueError(f"q has {h} heads and {k_name} {hkv}: the query heads must be a "
                         "multiple of the key/value heads (query head i uses kv head "
                         "i // (H / Hkv))")


def _no_variant_with_gqa(gqa, variant):
    """Grouped-query heads split the head axis; the variants' tensors (bias, mask, ALiBi slopes)
    broadcast against the caller's axes. The two are not combined yet: refuse, never guess."""
    if gqa is not None and variant and any(x is not None for x in variant.values()):
        raise ValueError(
            "grouped-query heads (q with more heads than k and v on axis -3) cannot be combined "
            "with window/softcap/alibi_slopes/bias/mask/score_mod/mask_mod yet; repeat k and v "
            "to q's head count "
            "(or give them a size-1 head axis) to use a variant")


def check_attention(q, k, v, *, causal, scale, return_lse, out, stream, kernel,
                    precision=None, variant=None, workspace=None) -> Problem:
    """Validate the arguments of `cuflash.attention` and return a `Problem`. ``variant``: a dict
    of the variant keyword arguments (see `check_variant`); ``workspace``: see
    `check_workspace`."""
    q0, k0, v0 = q, k, v
    backend, device_id, q, k, v, dt, batch, sq, sk, d, dv = _check_qkv(q, k, v)
    gqa = _gqa.grouping(tuple(np.shape(q0)), tuple(np.shape(k0)), tuple(np.shape(v0)))
    _no_variant_with_gqa(gqa, variant)
    var = check_variant(variant, backend, device_id, batch, sq, sk)
    pub = gqa.public_batch(batch) if gqa else batch

    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if not isinstance(return_lse, (bool, np.bool_)):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    scale = check_scale(scale, d, dt)
    _check_kernel(kernel, backend)
    precision = check_precision(precision)

    out_o = out_lse = None
    if out is not None:
        if isinstance(out, (tuple, list)):
            if not return_lse or len(out) != 2:
                raise ValueError("out may be a pair (o, lse) (a tuple or a list of two) only "
                                 "with return_lse=True; otherwise pass the o buffer alone")
            out_o, out_lse = out
        else:
            out_o = out
    o_shape = pub + (sq, dv)
    out_o = _check_out("out", out_o, o_shape, dt, backend, device_id)
    out_lse = _check_out("out[1] (lse)", out_lse, pub + (sq,), dt, backend, device_id,
                         check_dtype_name="float32")
    if out_lse is not None and not out_lse.flags.c_contiguous:
        raise ValueError("out[1] (lse) must be C-contiguous")
    no_overlap([("out[0] (o)", out_o), ("out[1] (lse)", out_lse)])
    out_public = None
    if gqa is not None and (out_o is not None or out_lse is not None):
        out_public = (out_o, out_lse)
        out_o = None if out_o is None else gqa.split(out_o)
        out_lse = None if out_lse is None else gqa.split(out_lse, -2)

    if stream is not None and backend == "cpu":
        raise ValueError("stream= applies to GPU inputs only; the inputs are NumPy arrays")
    workspace = check_workspace(workspace, backend, device_id)

    if backend == "gpu":
        # The kernels read rows through a stride but need a contiguous last axis: copy once if not.
        q, k, v = (_interop.last_axis_contiguous(x) for x in (q, k, v))

    return Problem(backend=backend, q=q, k=k, v=v, dtype_name=dt, batch_shape=batch, sq=int(sq),
                   sk=int(sk), d=int(d), dv=int(dv), causal=bool(causal), scale=scale,
                   return_lse=bool(return_lse), out=out_o, out_lse=out_lse, stream=stream,
                   kernel=kernel, device_id=device_id, precision=precision, gqa=gqa,
                   out_public=out_public, variant=var, workspace=workspace)


def check_workspace(workspace, backend, device_id):
    """The ``workspace=`` argument of the entry points that take one (`attention_backward`,
    `attention`, `attention_with_kvcache`, `attention_varlen`): None, or a C-contiguous GPU
    array on the inputs' device, returned as a flat uint8 view. Its size and alignment depend on
    the launch and are checked there (`_launch.workspace_base`), still before any launch."""
    if workspace is None:
        return None
    if backend == "cpu":
        raise ValueError("workspace= applies to GPU inputs only; the inputs are NumPy arrays")
    _refuse_subclass("workspace", workspace)
    wb = _interop.backend_of(workspace, "workspace")
    if wb != (backend, device_id):
        raise ValueError(f"workspace is on {_interop.describe(*wb)} but the inputs are on "
                         f"{_interop.describe(backend, device_id)}")
    workspace = _interop.as_backend_array(workspace, backend)
    if not workspace.flags.c_contiguous:
        raise ValueError("workspace must be C-contiguous")
    return workspace.reshape(-1).view("uint8")


def _check_forward_results(o, do, lse, o_shape, lse_shape, dt, backend, device_id, entry):
    """The backward's o, do (both `o_shape`, dtype `dt`) and lse (`lse_shape`, float32): on q's
    device, as arrays of its backend, with the shapes `entry` (the forward's name) returned.
    Returns {"o": ..., "do": ..., "lse": ...}."""
    arrays = {}
    for name, x, shape, want in (("o", o, o_shape, dt), ("do", do, o_shape, dt),
                                 ("lse", lse, lse_shape, "float32")):
        _refuse_subclass(name, x)
        b = _interop.backend_of(x, name)
        if b != (backend, device_id):
            raise ValueError(f"{name} is on {_interop.describe(*b)} but q, k and v are on "
                             f"{_interop.describe(backend, device_id)}")
        x = _interop.as_backend_array(x, backend)
        if tuple(x.shape) != tuple(shape):
            what = "o's shape" if name == "do" else f"the shape {entry} returned"
            raise ValueError(f"{name} has shape {tuple(x.shape)}; expected {tuple(shape)} "
                             f"({what} for these q, k, v)")
        got = _check_array_dtype(name, x) if name != "lse" else dtype_name(x.dtype)
        if got != want:
            raise TypeError(f"{name} has dtype {got}; expected {want}")
        arrays[name] = x
    return arrays


def _no_self_overlap(name, buf):
    """An output buffer must not be a broadcast view (stride 0 on an axis of size > 1): each of
    its elements is written once."""
    if buf is not None and any(n > 1 and st == 0 for n, st in zip(buf.shape, buf.strides)):
        raise ValueError(f"{name} has stride 0 on an axis of size > 1 (a broadcast view); pass "
                         "a buffer whose elements do not overlap")
    return buf


def check_grad_buffers(out, shapes, dt, backend, device_id):
    """The backward's ``out=(dq, dk, dv)``: a tuple or list of three buffers (none of them None)
    of the given shapes and dtype `dt` on the inputs' device (`_check_out`), no two sharing
    memory. Returns them as backend arrays."""
    if not isinstance(out, (tuple, list)) or len(out) != 3:
        raise ValueError("out must be a tuple (dq, dk, dv) of three buffers")
    names = ("out[0] (dq)", "out[1] (dk)", "out[2] (dv)")
    for n, buf in zip(names, out):
        if buf is None:
            raise ValueError(f"{n} is None; out must hold all three gradient buffers (or pass "
                             "out=None to have them allocated)")
    grads = tuple(_check_out(n, buf, shape, dt, backend, device_id)
                  for n, buf, shape in zip(names, out, shapes))
    no_overlap(list(zip(names, grads)))
    return grads


def check_backward(do, q, k, v, o, lse, *, causal, scale, deterministic, out, workspace, stream,
                   kernel, variant=None, return_dbias=False, precision=None) -> BackwardProblem:
    """Validate the arguments of `cuflash.attention_backward` and return a `BackwardProblem`.

    q, k, v go through the forward's checks (`_check_qkv`); o, do, lse must be what the forward
    returned for them: o and do of shape (..., Sq, Dv) and the inputs' dtype, lse float32 of
    shape (..., Sq), ``...`` the broadcast batch shape, all on the inputs' device.
    """
    shapes0 = tuple(tuple(np.shape(x)) for x in (q, k, v))
    backend, device_id, q, k, v, dt, batch, sq, sk, d, dv = _check_qkv(q, k, v)
    gqa = _gqa.grouping(*shapes0)
    _no_variant_with_gqa(gqa, variant)
    var = check_variant(variant, backend, device_id, batch, sq, sk)
    if var is not None:
        var.need_grad(bool(return_dbias))   # a score_mod without its derivative: none
    if not isinstance(return_dbias, (bool, np.bool_)):
        raise TypeError(f"return_dbias must be a bool, got {type(return_dbias).__name__}")
    if return_dbias and (var is None or var.bias is None):
        raise ValueError("return_dbias=True needs bias= (the gradient of which bias?)")
    pub = gqa.public_batch(batch) if gqa else batch
    o_shape, lse_shape = pub + (sq, dv), pub + (sq,)
    arrays = _check_forward_results(o, do, lse, o_shape, lse_shape, dt, backend, device_id,
                                    "attention")

    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if not isinstance(deterministic, (bool, np.bool_)):
        raise TypeError(f"deterministic must be a bool, got {type(deterministic).__name__}")
    scale = check_scale(scale, d, dt)
    _check_kernel(kernel, backend)
    precision = check_precision(precision)

    grads = None
    if out is not None:
        grads = check_grad_buffers(out, shapes0, dt, backend, device_id)

    if stream is not None and backend == "cpu":
        raise ValueError("stream= applies to GPU inputs only; the inputs are NumPy arrays")
    workspace = check_workspace(workspace, backend, device_id)

    o, do, lse = arrays["o"], arrays["do"], arrays["lse"]
    out_public = None
    if gqa is not None:
        o, do, lse = gqa.split(o), gqa.split(do), gqa.split(lse, -2)
        if grads is not None:
            out_public, grads = grads, tuple(gqa.split(g) for g in grads)
    if backend == "gpu":
        # lse is read through its strides (BwdParams.lse_sr); the others need a contiguous last axis.
        q, k, v, o, do = (_interop.last_axis_contiguous(x) for x in (q, k, v, o, do))

    return BackwardProblem(
        backend=backend, q=q, k=k, v=v, dtype_name=dt, batch_shape=batch, sq=sq, sk=sk, d=d,
        dv=dv, causal=bool(causal), scale=scale, return_lse=False, out=None, out_lse=None,
        stream=stream, kernel=kernel, device_id=device_id, o=o, do=do, lse=lse,
        deterministic=bool(deterministic), out_grads=grads, workspace=workspace, gqa=gqa,
        out_public=out_public, grad_shapes_public=shapes0, variant=var,
        return_dbias=bool(return_dbias), precision=precision)


def check_merge(o_a, lse_a, o_b, lse_b):
    """Validate `merge_states` arguments; returns (backend, device_id, arrays, dtype name)."""
    items = (("o_a", o_a), ("lse_a", lse_a), ("o_b", o_b), ("lse_b", lse_b))
    for name, x in items:
        _refuse_subclass(name, x)
    backends = [_interop.backend_of(x, n) for n, x in items]
    if len(set(backends)) != 1:
        desc = ", ".join(f"{n} on {_interop.describe(*b)}" for (n, _), b in zip(items, backends))
        raise ValueError(f"merge_states inputs must be on one device; got {desc}")
    backend, device_id = backends[0]
    o_a, lse_a, o_b, lse_b = (_interop.as_backend_array(x, backend) for _, x in items)
    if o_a.ndim < 1 or 0 in o_a.shape:
        raise ValueError(f"o_a must have shape (..., Sq, Dv) with no zero-length axis; got {tuple(o_a.shape)}")
    if tuple(o_a.shape) != tuple(o_b.shape):
        raise ValueError(f"o_a and o_b must have the same shape; got {tuple(o_a.shape)} and {tuple(o_b.shape)}")
    want_lse = tuple(o_a.shape[:-1])
    for n, x in (("lse_a", lse_a), ("lse_b", lse_b)):
        if tuple(x.shape) != want_lse:
            raise ValueError(f"{n} has shape {tuple(x.shape)}; expected {want_lse} (o's shape without its last axis)")
        if dtype_name(x.dtype) != "float32":
            raise TypeError(f"{n} has dtype {dtype_name(x.dtype)}; expected float32")
    da, db = _check_array_dtype("o_a", o_a), _check_array_dtype("o_b", o_b)
    if da != db:
        raise TypeError(f"o_a and o_b must have the same dtype; got {da} and {db}")
    return backend, device_id, (o_a, lse_a, o_b, lse_b), da


def public_forward(prob, o, lse):
    """The results of a forward `prob` in the caller's shapes: undoes a grouped-query split
    (returning the caller's own ``out`` buffers when given)."""
    g = prob.gqa
    if g is None:
        return o, lse
    pub_o, pub_lse = prob.out_public or (None, None)
    o = pub_o if pub_o is not None else g.merge(o)
    if lse is not None:
        lse = pub_lse if pub_lse is not None else g.merge(lse, -2)
    return o, lse


def public_grads(prob, dq, dk, dv, *extra):
    """(dq, dk, dv) of a `BackwardProblem` in the caller's q, k, v shapes, followed by `extra`
    (dbias with ``return_dbias``; variants and grouped-query heads do not combine)."""
    if prob.gqa is None:
        return (dq, dk, dv) + extra
    if prob.out_public is not None:
        return tuple(prob.out_public)
    return tuple(x.reshape(s) for x, s in zip((dq, dk, dv), prob.grad_shapes_public))
