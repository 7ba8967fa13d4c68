"""`attention_with_kvcache`: decoding against a contiguous or paged KV cache, with an in-place
append of new keys and values (notes/INFERENCE.md).

Layouts (FlashAttention's): q ``(B, Sq, H, D)``; a contiguous cache ``(B, Smax, Hkv, D)`` or a
paged one ``(num_pages, page_size, Hkv, D)`` with ``block_table`` ``(B, max_pages)`` int32;
``cache_seqlens`` ``(B,)`` int32; ``k_new``/``v_new`` ``(B, Snew, Hkv, D)``; o ``(B, Sq, H, D)``
and lse ``(B, H, Sq)``. The GPU path runs kernels_cu/attn_decode.cu (append kernel, decode
kernel through the block table, combine); the CPU path appends with NumPy and runs the NumPy
recurrence per sequence.
"""
from __future__ import annotations

import numbers
import struct
import sys
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from . import _callcache, _checks, _decode, _gqa, _interop
from ._callcache import _arr_key, outputs_key

KVCACHE_KERNELS = ("auto", "decode")
#: Smallest page of a paged cache: one key tile of the decode kernel (pages are powers of two).
MIN_PAGE = 16


@dataclass(kw_only=True)
class CallOptions:
    """What every inference entry point carries besides its tensors (see check_call_options)."""

    causal: bool
    scale: float
    return_lse: bool
    out: Any
    out_lse: Any
    stream: Any
    kernel: str
    workspace: Any = None        # None or a flat uint8 GPU buffer (_checks.check_workspace)


@dataclass
class KVCacheProblem(CallOptions):
    backend: str
    device_id: Optional[int]
    q: Any
    k_cache: Any
    v_cache: Any
    seqlens: Any                 # backend int32 array (B,)
    block_table: Any             # backend int32 (B, max_pages) or None
    k_new: Any
    v_new: Any
    dtype_name: str
    b: int
    sq: int
    h: int
    hkv: int
    d: int
    dv: int
    snew: int
    page: int                    # 0 for a contiguous cache
    capacity: int                # keys a sequence can hold
    # cache_seqlens given as an int on the GPU: its value (then ``seqlens`` is None and no
    # device array is made for it unless k_new is appended); None otherwise.
    seqlens_int: Optional[int] = None


def _int32_array(name, x, backend, device_id, shape_desc, ndim):
    b, dev = _interop.backend_of(x, name)
    if (b, dev) != (backend, device_id):
        raise ValueError(f"{name} is on {_interop.describe(b, dev)} but q is on "
                         f"{_interop.describe(backend, device_id)}")
    x = _interop.as_backend_array(x, backend)
    if x.dtype != np.int32:
        raise TypeError(f"{name} has dtype {x.dtype}; expected int32")
    if x.ndim != ndim:
        raise ValueError(f"{name} must have shape {shape_desc}; got {tuple(x.shape)}")
    if backend == "gpu" and not x.flags.c_contiguous:
        # The kernels read it at data.ptr as a C-contiguous int32 array (no stride in their
        # parameter blocks; a block table's rows shape[1] apart): a strided view would be read
        # as other values with no error. NumPy inputs are indexed, any strides.
        raise ValueError(f"{name} must be C-contiguous on the GPU (strides {tuple(x.strides)} "
                         f"for shape {tuple(x.shape)}); pass a contiguous copy")
    return x


def check_call_options(*, causal, return_lse, scale, d, dt, kernel, choices, backend, device_id,
                       stream, out, o_shape, lse_shape, workspace=None):
    """The checks the inference entry points share with `attention`: causal and return_lse
    bools, the scale, the kernel choice, stream and workspace only for GPU inputs, and out (o or
    (o, lse)) of the given shapes. Returns (scale, o buffer or None, lse buffer or None,
    workspace as a flat uint8 view or None)."""
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if not isinstance(return_lse, (bool, np.bool_)):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    scale = _checks.check_scale(scale, d, dt)
    if kernel not in choices:
        raise ValueError(f"kernel must be one of {choices}, got {kernel!r}")
    if backend == "cpu" and kernel != "auto":
        raise ValueError(f"kernel={kernel!r} selects a GPU kernel, but the inputs are on the CPU "
                         "(NumPy); pass GPU arrays or kernel='auto'")
    if stream is not None and backend == "cpu":
        raise ValueError("stream= applies to GPU inputs only; the inputs are NumPy arrays")
    out_o = out_lse = None
    if out is not None:
        if isinstance(out, (tuple, list)):
            if not return_lse or len(out) != 2:
                raise ValueError("out may be a pair (o, lse) only with return_lse=True")
            out_o, out_lse = out
        else:
            out_o = out
    out_o = _checks._check_out("out", out_o, o_shape, dt, backend, device_id)
    out_lse = _checks._check_out("out[1] (lse)", out_lse, lse_shape, dt, backend, device_id,
                                 check_dtype_name="float32")
    _checks.no_overlap([("out[0] (o)", out_o), ("out[1] (lse)", out_lse)])
    return scale, out_o, out_lse, _checks.check_workspace(workspace, backend, device_id)


def check_kvcache(q, k_cache, v_cache, cache_seqlens, *, block_table, k_new, v_new, causal,
                  scale, return_lse, out, stream, kernel, workspace=None) -> KVCacheProblem:
    """Validate `attention_with_kvcache`'s arguments (no launch, no device synchronisation)."""
    for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        _checks._refuse_subclass(name, x)
    backends = [_interop.backend_of(x, n) for x, n in
                ((q, "q"), (k_cache, "k_cache"), (v_cache, "v_cache"))]
    if len(set(backends)) != 1:
        raise ValueError("q, k_cache and v_cache must be on the same device; got "
                         + ", ".join(f"{n} on {_interop.describe(*b)}"
                                     for n, b in zip(("q", "k_cache", "v_cache"), backends)))
    backend, device_id = backends[0]
    q, k_cache, v_cache = (_interop.as_backend_array(x, backend) for x in (q, k_cache, v_cache))
    if q.ndim != 4:
        raise ValueError(f"q must have shape (B, Sq, H, D); got {tuple(q.shape)}")
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
        if x.ndim != 4:
            raise ValueError(f"{name} must have shape (B, Smax, Hkv, D) or, paged, (num_pages, "
                             f"page_size, Hkv, D); got {tuple(x.shape)}")
    for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if 0 in x.shape:
            raise ValueError(f"{name} has a zero-length axis: shape {tuple(x.shape)}")
    names = [_checks._check_array_dtype(n, x) for n, x in
             (("q", q), ("k_cache", k_cache), ("v_cache", v_cache))]
    if len(set(names)) != 1:
        raise TypeError(f"q, k_cache and v_cache must have the same dtype; got {', '.join(names)}")
    dt = names[0]
    b, sq, h, d = (int(n) for n in q.shape)
    if tuple(k_cache.shape[:3]) != tuple(v_cache.shape[:3]):
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} "
                         "must agree on all axes but the last")
    hkv, dk, dv = int(k_cache.shape[2]), int(k_cache.shape[3]), int(v_cache.shape[3])
    _checks.check_packed_heads("k_cache", "v_cache", h, hkv, d, dk, dv)
    if block_table is None:
        if k_cache.shape[0] != b:
            raise ValueError(f"a contiguous cache has one row per sequence: k_cache has "
                             f"{k_cache.shape[0]}, q has batch {b} (pass block_table= for a "
                             "paged cache)")
        page, capacity = 0, int(k_cache.shape[1])
    else:
        block_table = _int32_array("block_table", block_table, backend, device_id,
                                   "(B, max_pages)", 2)
        if block_table.shape[0] != b:
            raise ValueError(f"block_table has {block_table.shape[0]} rows; q has batch {b}")
        page = int(k_cache.shape[1])
        if page < MIN_PAGE or page & (page - 1):
            raise ValueError(f"the page size (axis 1 of a paged cache) must be a power of two >= "
                             f"{MIN_PAGE}; got {page}")
        capacity = page * int(block_table.shape[1])
    seqlens_int = None
    if isinstance(cache_seqlens, numbers.Integral) and not isinstance(cache_seqlens, bool):
        seqlens_int = int(cache_seqlens)
        # (on the GPU no device array: the decode takes the common length as its key count)
        cache_seqlens = np.full((b,), seqlens_int, dtype=np.int32) if backend == "cpu" else None
    else:
        cache_seqlens = _int32_array("cache_seqlens", cache_seqlens, backend, device_id, "(B,)", 1)
    if cache_seqlens is not None and cache_seqlens.shape[0] != b:
        raise ValueError(f"cache_seqlens has {cache_seqlens.shape[0]} entries; q has batch {b}")
    if (k_new is None) != (v_new is None):
        raise ValueError("k_new and v_new go together: pass both or neither")
    snew = 0
    if k_new is not None:
        news = []
        for name, x, last in (("k_new", k_new, d), ("v_new", v_new, dv)):
            _checks._refuse_subclass(name, x)
            bx = _interop.backend_of(x, name)
            if bx != (backend, device_id):
                raise ValueError(f"{name} is on {_interop.describe(*bx)} but q is on "
                                 f"{_interop.describe(backend, device_id)}")
            x = _interop.as_backend_array(x, backend)
            if x.ndim != 4 or x.shape[0] != b or x.shape[2] != hkv or x.shape[3] != last:
                raise ValueError(f"{name} must have shape (B={b}, Snew, Hkv={hkv}, {last}); "
                                 f"got {tuple(x.shape)}")
            if _checks._check_array_dtype(name, x) != dt:
                raise TypeError(f"{name} has dtype {x.dtype}; expected {dt}")
            news.append(x)
        k_new, v_new = news
        if k_new.shape[1] != v_new.shape[1] or k_new.shape[1] == 0:
            raise ValueError(f"k_new and v_new must hold the same number (>= 1) of new keys; got "
                             f"{k_new.shape[1]} and {v_new.shape[1]}")
        snew = int(k_new.shape[1])
    if snew:   # appended in place: each cache element written once, by one of the two caches
        for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
            if backend == "cpu" and not x.flags.writeable:
                raise ValueError(f"{name} is read-only; k_new and v_new are appended into the "
                                 "caches in place")
            _checks._no_self_overlap(name, x)
    if seqlens_int is not None and not 0 <= seqlens_int <= capacity - snew:
        raise ValueError(f"cache_seqlens must lie in [0, {capacity - snew}] (capacity "
                         f"{capacity} keys{' with ' + str(snew) + ' appended' if snew else ''}"
                         f"); got {seqlens_int}")
    if backend == "cpu":  # the lengths are on the host: check them (the GPU path cannot, see docs)
        lens = np.asarray(cache_seqlens)
        if lens.min() < 0 or lens.max() + snew > capacity:
            raise ValueError(f"cache_seqlens must lie in [0, {capacity - snew}] (capacity "
                             f"{capacity} keys{' with ' + str(snew) + ' appended' if snew else ''}"
                             f"); got {lens.min()}..{lens.max()}")
        if block_table is not None:
            need = -(-(lens + snew) // page)
            for i in range(b):
                used = block_table[i, :need[i]]
                if used.size and (used.min() < 0 or used.max() >= k_cache.shape[0]):
                    raise ValueError(f"block_table row {i} names pages outside "
                                     f"[0, {k_cache.shape[0]})")
    scale, out_o, out_lse, workspace = check_call_options(
        causal=causal, return_lse=return_lse, scale=scale, d=d, dt=dt, kernel=kernel,
        choices=KVCACHE_KERNELS, backend=backend, device_id=device_id, stream=stream, out=out,
        o_shape=(b, sq, h, dv), lse_shape=(b, h, sq), workspace=workspace)
    if backend == "gpu":
        q, k_new, v_new = (None if x is None else _interop.last_axis_contiguous(x)
                           for x in (q, k_new, v_new))
        for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
            if x.strides[-1] != x.itemsize:
                raise ValueError(f"{name} must have a contiguous last axis (it is written in "
                                 "place, so it cannot be copied)")
    return KVCacheProblem(backend, device_id, q, k_cache, v_cache, cache_seqlens, block_table,
                          k_new, v_new, dt, b, sq, h, hkv, d, dv, snew, page, capacity,
                          seqlens_int if backend == "gpu" else None,
                          causal=bool(causal), scale=scale, return_lse=bool(return_lse),
                          out=out_o, out_lse=out_lse, stream=stream, kernel=kernel,
                          workspace=workspace)


# ---------------------------------------------------------------------------------------------
# CPU path

def _append_numpy(prob):
    lens = np.asarray(prob.seqlens)
    for i in range(prob.b):
        keys = np.arange(lens[i], lens[i] + prob.snew)
        if prob.block_table is None:
            prob.k_cache[i, keys] = prob.k_new[i]
            prob.v_cache[i, keys] = prob.v_new[i]
        else:
            pages = prob.block_table[i, keys // prob.page]
            prob.k_cache[pages, keys % prob.page] = prob.k_new[i]
            prob.v_cache[pages, keys % prob.page] = prob.v_new[i]


def one_sequence_numpy(q, k, v, *, causal, scale):
    """One sequence in FlashAttention's layout on the CPU: q (Sq, H, D), k (Sk, Hkv, D),
    v (Sk, Hkv, Dv) -> o (Sq, H, Dv), lse (H, Sq), grouped heads as in `attention`."""
    from ._cpu import attention_numpy

    sq, h = q.shape[:2]
    qt, kt, vt = (x.transpose(1, 0, 2) for x in (q, k, v))
    if k.shape[1] not in (1, h):
        grp = _gqa.Grouping(h, k.shape[1])
        qt, kt, vt = grp.split(qt), grp.split(kt), grp.split(vt)
    o, lse = attention_numpy(qt, kt, vt, causal=causal, scale=scale, out=None, need_lse=True)
    return o.reshape(h, sq, v.shape[-1]).transpose(1, 0, 2), lse.reshape(h, sq)


def kvcache_numpy(prob):
    """The CPU path: append, then per sequence the NumPy recurrence over its keys."""
    from .reference import gather_kv_cache

    if prob.snew:
        _append_numpy(prob)
    o = np.empty((prob.b, prob.sq, prob.h, prob.dv), dtype=prob.q.dtype)
    lse = np.empty((prob.b, prob.h, prob.sq), dtype=np.float32)
    lens = np.asarray(prob.seqlens) + prob.snew
    for i in range(prob.b):
        if lens[i] == 0:
            o[i] = 0
            lse[i] = -np.inf
            continue
        k_i, v_i = gather_kv_cache(prob.k_cache, prob.v_cache, int(lens[i]), i, prob.block_table)
        o[i], lse[i] = one_sequence_numpy(prob.q[i], k_i, v_i, causal=prob.causal,
                                          scale=prob.scale)
    return into_out(prob, o), into_out_lse(prob, lse)


def into_out(prob, o):
    """The CPU paths' o, copied into the caller's o buffer when one was given. The CPU paths
    compute every sequence before writing ``out``, so that an out= buffer that aliases an input
    gives the same result as a fresh one (README, "Errors")."""
    if prob.out is None:
        return o
    prob.out[...] = o
    return prob.out


def into_out_lse(prob, lse):
    """The CPU paths' lse, copied into the caller's lse buffer when one was given."""
    if prob.out_lse is None:
        return lse
    prob.out_lse[...] = lse
    return prob.out_lse


# ---------------------------------------------------------------------------------------------
# GPU path

def _decode_keys(prob):
    """Keys the decode grid covers: the capacity when the lengths come from a device array, the
    common length ``cache_seqlens + Snew`` when cache_seqlens was an int."""
    return prob.capacity if prob.seqlens_int is None else prob.seqlens_int + prob.snew


def _lens_bytes(prob):
    """Workspace bytes of the lengths section: B int32 when k_new is appended (the decode's
    ``cache_seqlens + Snew`` or, for an int cache_seqlens, the append's start positions), else
    0."""
    from ._decode import _align

    return _align(4 * prob.b) if prob.snew else 0


def kvcache_launch(prob, attrs):
    """(decode plan, `_decode.DecodeLaunch`, workspace bytes) of a GPU `KVCacheProblem`. The
    workspace holds the lengths section (`_lens_bytes`), then the split partials
    (`DecodeLaunch.part_bytes`)."""
    from . import _decode

    plan = _decode.decode_plan(prob.dtype_name, prob.d, prob.causal, prob.block_table is not None,
                               rows=prob.h // prob.hkv * prob.sq)
    cfg = _decode.configure(plan, (1, prob.b, prob.hkv), prob.h // prob.hkv, prob.sq,
                            _decode_keys(prob), prob.d, attrs)
    return plan, cfg, _lens_bytes(prob) + cfg.part_bytes


def _append_block(prob, starts_ptr):
    """(AppendParams of the in-place append of k_new, v_new at key positions ``starts[b]``
    (the int32 (B,) array at `starts_ptr`), its grid of 256-thread blocks)."""
    from . import _decode

    paged = prob.block_table is not None
    kc, vc = prob.k_cache, prob.v_cache
    ie = [s // kc.itemsize for s in kc.strides]
    ve = [s // vc.itemsize for s in vc.strides]
    ap = np.zeros((), dtype=_decode.APPEND_PARAMS_DTYPE)
    ap["k_new"], ap["v_new"] = prob.k_new.data.ptr, prob.v_new.data.ptr
    ap["k"], ap["v"], ap["seqlens"] = kc.data.ptr, vc.data.ptr, starts_ptr
    ap["block_table"] = prob.block_table.data.ptr if paged else 0
    ap["b"], ap["snew"], ap["hkv"], ap["d"] = prob.b, prob.snew, prob.hkv, prob.d
    for pre, x in (("nk", prob.k_new), ("nv", prob.v_new)):
        e = [s // x.itemsize for s in x.strides]
        ap[f"{pre}_s1"], ap[f"{pre}_sr"], ap[f"{pre}_s2"] = e[0], e[1], e[2]
    if paged:
        ap["k_sr"], ap["k_s2"], ap["v_sr"], ap["v_s2"] = ie[1], ie[2], ve[1], ve[2]
        ap["k_page"], ap["v_page"] = ie[0], ve[0]
    else:
        ap["k_s1"], ap["k_sr"], ap["k_s2"] = ie[0], ie[1], ie[2]
        ap["v_s1"], ap["v_sr"], ap["v_s2"] = ve[0], ve[1], ve[2]
    ap["page_log2"] = prob.page.bit_length() - 1 if paged else 0
    ap["bt_stride"] = prob.block_table.shape[1] if paged else 0
    n = prob.b * prob.snew * prob.hkv * (prob.d // 8)
    return ap[()], -(-n // 256)


def _append(prob, starts, stream):
    """Launch the in-place append of k_new, v_new at key positions ``starts[b]`` (int32, (B,))."""
    from . import _compile, _decode

    block, grid = _append_block(prob, starts.data.ptr)
    kern = _compile.get_kernel(_decode.append_spec(prob.dtype_name, prob.block_table is not None),
                               prob.device_id)
    kern((grid,), (256,), (block,), stream=stream)


def kvcache_gpu(prob, call=None):
    """The GPU path: append (kv_append), then decode through the cache (and the combine), all on
    the launch stream; scratch in ``prob.workspace`` or, without one, a pool allocation on that
    stream. No host synchronisation. `call`: this call's signature (`_kv_signature`), recorded
    after the launch so that the next call with it takes the hit path."""
    import cupy

    from . import _decode, _launch

    with cupy.cuda.Device(prob.device_id):
        attrs = _decode.attrs_or_raise(prob, "attention_with_kvcache", [
            prob.q, prob.k_cache, prob.v_cache, prob.k_new, prob.v_new, prob.out])
        st = _launch._stream_ptr(prob.stream)
        plan, cfg, need = kvcache_launch(prob, attrs)
        ws = _decode.scratch(need, prob.workspace, st, "attention_with_kvcache_workspace_size")
        lens_bytes = _lens_bytes(prob)
        paged = prob.block_table is not None
        kc, vc = prob.k_cache, prob.v_cache
        with st:
            o = prob.out if prob.out is not None else cupy.empty(
                (prob.b, prob.sq, prob.h, prob.dv), dtype=prob.q.dtype)
            lse = prob.out_lse
            if prob.return_lse and lse is None:
                lse = cupy.empty((prob.b, prob.h, prob.sq), dtype=cupy.float32)
            seqlens = prob.seqlens          # the decode's key counts (None: every sequence sk)
            if prob.snew:
                lens_ws = ws[:lens_bytes].view(cupy.int32)[:prob.b]
                if prob.seqlens_int is None:
                    _append(prob, prob.seqlens, st)
                    cupy.add(prob.seqlens, np.int32(prob.snew), out=lens_ws)
                    seqlens = lens_ws
                else:
                    lens_ws.fill(prob.seqlens_int)
                    _append(prob, lens_ws, st)
            sk = _decode_keys(prob)
            if sk == 0:  # an int cache_seqlens of 0 and nothing appended: every sequence empty
                o.fill(0)
                if lse is not None:
                    lse.fill(-np.inf)
                return o, lse
        g = prob.h // prob.hkv
        ie = [s // kc.itemsize for s in kc.strides]
        ve = [s // vc.itemsize for s in vc.strides]
        qe = [s // prob.q.itemsize for s in prob.q.strides]
        oe = [s // o.itemsize for s in o.strides]
        le = [s // 4 for s in lse.strides] if lse is not None else [0, 0, 0]
        if paged:
            k_str, v_str = (0, 0, ie[2], ie[1]), (0, 0, ve[2], ve[1])
        else:
            k_str, v_str = (0, ie[0], ie[2], ie[1]), (0, ve[0], ve[2], ve[1])
        geom = _decode.DecodeGeometry(
            sizes=(1, prob.b, prob.hkv), g=g, sq=prob.sq, sk=sk, d=prob.d,
            q=(0, qe[0], g * qe[2], qe[2], qe[1]), o=(0, oe[0], g * oe[2], oe[2], oe[1]),
            l=(0, le[0], g * le[1], le[1], le[2]), k=k_str, v=v_str, seqlens=seqlens,
            block_table=prob.block_table, page=prob.page, k_page=ie[0] if paged else 0,
            v_page=ve[0] if paged else 0)
        parts = ws[lens_bytes:] if cfg.splits > 1 else None
        _decode.launch(plan, geom, prob.q, kc, vc, o, lse, scale=prob.scale,
                       device_id=prob.device_id, stream=st, cfg=cfg, parts=parts)
        if call is not None:
            _kv_record(call, prob, plan, cfg, geom, o, lse, parts, lens_bytes, need)
    return o, lse


# ---------------------------------------------------------------------------------------------
# The call cache of attention_with_kvcache (a decode step's hit path; notes/INFERENCE.md,
# "attention_with_kvcache": the call cache)

#: signature -> _KVRecord; the oldest goes when full.
_KV_RECORDS = {}
_KV_RECORDS_SIZE = 64
#: DecodeParams' first 11 fields (q, k, v, o, lse, o_part, lse_part, seqlens, block_table,
#: cu_q, cu_k) and AppendParams' first 6 (k_new, v_new, k, v, seqlens, block_table) are the
#: pointers a hit writes; the rest of each block is a function of the signature.
_DEC_NPTR, _APP_NPTR = 11, 6


def _kv_signature(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, causal, scale,
                  return_lse, out, workspace, kernel):
    """``(key, ptrs)`` of an `attention_with_kvcache` call whose arrays are all plain CuPy
    arrays (``ptrs``: q, k_cache, v_cache, cache_seqlens (0 for an int), block_table, k_new,
    v_new; 0 where absent), or None (NumPy, torch or anything else: the full path). The key
    holds each array's shape, strides, dtype, device and ``ptr & 15``, an int cache_seqlens by
    value (it sets the key count), out's and workspace's layouts (`_callcache.outputs_key`)
    and the flags with their types."""
    cp = sys.modules.get("cupy")
    if cp is None or type(q) is not cp.ndarray:
        return None
    nd = cp.ndarray
    ptrs = []
    try:
        keys = [_arr_key(x, nd, None, ptrs) for x in (q, k_cache, v_cache)]
        if type(cache_seqlens) is int:
            keys.append(("int", cache_seqlens))
            ptrs.append(0)
        else:
            keys.append(_arr_key(cache_seqlens, nd, None, ptrs))
        for x in (block_table, k_new, v_new):
            if x is None:
                keys.append(None)
                ptrs.append(0)
            else:
                keys.append(_arr_key(x, nd, None, ptrs))
        ok, wk = outputs_key(out, workspace, nd)
    except LookupError:
        return None
    key = (tuple(keys), ok, wk, type(causal), causal, type(scale), scale, type(return_lse),
           return_lse, type(kernel), kernel)
    return key, tuple(ptrs)


class _KVRecord:
    """What a full `kvcache_gpu` call established for a signature: the outputs' shapes, the
    scratch layout (lengths section, split partials), the kernels, their grids and the
    parameter blocks' bytes after their pointers, and the tables' generation."""

    __slots__ = ("tables", "device_id", "o_shape", "lse_shape", "dtype", "return_lse", "need",
                 "lens_bytes", "b", "snew", "seqlens_int", "splits", "o_part_bytes", "dec",
                 "dec_t", "dec_smem", "dec_tmpl", "comb", "comb_t", "app", "app_t", "app_tmpl",
                 "pair_spans")


def _kv_record(call, prob, plan, cfg, geom, o, lse, parts, lens_bytes, need):
    """Record `call` after its full-path launch, unless the checks copied an input (the kernels
    must read and write the caller's buffers) or nothing was launched."""
    from . import _compile, _decode

    key, ptrs = call
    try:
        hash(key)
    except TypeError:
        return
    seen = tuple(0 if x is None else x.data.ptr for x in (
        prob.q, prob.k_cache, prob.v_cache, prob.seqlens, prob.block_table, prob.k_new,
        prob.v_new))
    if seen != ptrs:
        return
    rec = _KVRecord()
    rec.tables = _callcache._tables()
    rec.device_id, rec.dtype, rec.return_lse = prob.device_id, o.dtype, prob.return_lse
    rec.o_shape = tuple(o.shape)
    rec.lse_shape = None if lse is None else tuple(lse.shape)
    # Byte spans of the caller's o and lse, which must not share memory: a hit whose spans meet
    # takes the full path (`_hit_may_overlap`)
    rec.pair_spans = None if prob.out_lse is None else (
        _checks.span_offsets(prob.out), _checks.span_offsets(prob.out_lse))
    rec.need, rec.lens_bytes, rec.b, rec.snew = need, lens_bytes, prob.b, prob.snew
    rec.seqlens_int, rec.splits, rec.o_part_bytes = prob.seqlens_int, cfg.splits, \
        cfg.o_part_bytes
    params = _decode.decode_params(plan, geom, prob.q, prob.k_cache, prob.v_cache, o, lse,
                                   scale=prob.scale, cfg=cfg, parts=parts)
    rec.dec_tmpl = params.tobytes()[8 * _DEC_NPTR:]
    rec.dec = _compile.get_kernel(plan.spec, prob.device_id, plan.smem_bytes)
    rec.dec_t, rec.dec_smem = ((cfg.grid,), (plan.threads,)), plan.smem_bytes
    rec.comb = rec.comb_t = None
    if cfg.splits > 1:
        rec.comb = _compile.get_kernel(_decode.combine_spec_for(plan, cfg), prob.device_id)
        rec.comb_t = (cfg.comb_grid, (_decode.COMBINE_THREADS,))
    rec.app = rec.app_t = rec.app_tmpl = None
    if prob.snew:
        block, grid = _append_block(prob, 0)
        rec.app_tmpl = block.tobytes()[8 * _APP_NPTR:]
        rec.app = _compile.get_kernel(_decode.append_spec(prob.dtype_name,
                                                          prob.block_table is not None),
                                      prob.device_id)
        rec.app_t = ((grid,), (256,))
    if len(_KV_RECORDS) >= _KV_RECORDS_SIZE:
        _KV_RECORDS.pop(next(iter(_KV_RECORDS)), None)
    _KV_RECORDS[key] = rec


def _kv_lookup(key):
    """The valid record of `key`, or None (also for an unhashable key)."""
    try:
        rec = _KV_RECORDS.get(key)
    except TypeError:
        return None
    return rec if rec is not None and rec.tables == _callcache._GEN[0] else None


def _hit_may_overlap(rec, out):
    """Whether a hit of `rec` with ``out=(o, lse)`` has o and lse byte spans that meet: then the
    full path's checks decide (`_checks.no_overlap`)."""
    if rec.pair_spans is not None:
        o, lse = out
        return _checks.spans_meet(o.data.ptr, rec.pair_spans[0], lse.data.ptr, rec.pair_spans[1])
    return False


def _kv_hit(rec, ptrs, cache_seqlens, out, workspace, stream):
    """Launch record `rec` with this call's buffers: what `kvcache_gpu` does for the signature,
    without its checks and planning."""
    cp = sys.modules["cupy"]
    dev = rec.device_id
    if cp.cuda.runtime.getDevice() != dev:
        with cp.cuda.Device(dev):
            return _kv_hit(rec, ptrs, cache_seqlens, out, workspace, stream)
    st = cp.cuda.get_current_stream() if stream is None else _callcache._stream(stream, dev)
    q_p, kc_p, vc_p, sl_p, bt_p, kn_p, vn_p = ptrs
    ws = _decode.scratch(rec.need, workspace, st, "attention_with_kvcache_workspace_size")
    with st:
        if out is None:
            o, lse = cp.empty(rec.o_shape, dtype=rec.dtype), None
        elif isinstance(out, (tuple, list)):
            o, lse = out
        else:
            o, lse = out, None
        if rec.return_lse and lse is None:
            lse = cp.empty(rec.lse_shape, dtype=cp.float32)
        dec_sl = sl_p
        if rec.snew:
            lens_ws = ws[:rec.lens_bytes].view(cp.int32)[:rec.b]
            if rec.seqlens_int is None:   # append at cache_seqlens, attend to cache_seqlens + Snew
                starts = sl_p
                _kv_launch(rec.app, rec.app_t, (kn_p, vn_p, kc_p, vc_p, starts, bt_p),
                           rec.app_tmpl, _decode.APPEND_PARAMS_DTYPE, st)
                cp.add(cache_seqlens, np.int32(rec.snew), out=lens_ws)
                dec_sl = lens_ws.data.ptr
            else:   # an int: the append's start positions; the decode takes the common count
                lens_ws.fill(rec.seqlens_int)
                _kv_launch(rec.app, rec.app_t, (kn_p, vn_p, kc_p, vc_p, lens_ws.data.ptr, bt_p),
                           rec.app_tmpl, _decode.APPEND_PARAMS_DTYPE, st)
                dec_sl = 0
    o_part = lse_part = 0
    if rec.splits > 1:
        o_part = ws.data.ptr + rec.lens_bytes
        lse_part = o_part + rec.o_part_bytes
    args = _kv_block((q_p, kc_p, vc_p, o.data.ptr, 0 if lse is None else lse.data.ptr, o_part,
                      lse_part, dec_sl, bt_p, 0, 0), rec.dec_tmpl, _decode.DECODE_PARAMS_DTYPE)
    rec.dec(*rec.dec_t, (args,), shared_mem=rec.dec_smem, stream=st)
    if rec.comb is not None:   # both kernels read one block (copied at each launch)
        rec.comb(*rec.comb_t, (args,), stream=st)
    return (o, lse) if rec.return_lse else o


def _kv_block(ptrs, tmpl, dtype):
    """A parameter block (NumPy structured scalar): `ptrs` (uint64 each), then `tmpl`."""
    return np.frombuffer(struct.pack(f"<{len(ptrs)}Q", *ptrs) + tmpl, dtype)[0]


def _kv_launch(kern, grid_block, ptrs, tmpl, dtype, stream):
    kern(*grid_block, (_kv_block(ptrs, tmpl, dtype),), stream=stream)


def kvcache_dispatch_label(prob):
    from . import _decode

    if prob.backend == "cpu":
        return "cpu-numpy"
    return _decode.decode_plan(prob.dtype_name, prob.d, prob.causal,
                               prob.block_table is not None,
                               rows=prob.h // prob.hkv * prob.sq).label


# ---------------------------------------------------------------------------------------------
# The public function

def attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, *, block_table=None, k_new=None,
                           v_new=None, causal=False, scale=None, return_lse=False, out=None,
                           workspace=None, stream=None, kernel="auto"):
    """Attention of new query rows against a KV cache, appending new keys and values first.

    For each sequence ``b``, ``k_new[b]`` and ``v_new[b]`` (if given) are written into the cache
    at key positions ``cache_seqlens[b] .. cache_seqlens[b] + Snew - 1`` (in place), and then
    ``q[b]`` attends to the sequence's first ``L_b = cache_seqlens[b] + Snew`` keys. As
    FlashAttention's ``flash_attn_with_kvcache``: ``cache_seqlens`` is not updated (add ``Snew``
    yourself for the next step).

    Parameters
    ----------
    q : array, shape (B, Sq, H, D)
        FlashAttention's layout (sequence before heads), unlike `attention`'s (..., Sq, D).
        float16, bfloat16, float32 or float64 (on the GPU: float16 and bfloat16).
    k_cache, v_cache : array, shape (B, Smax, Hkv, D) or paged (num_pages, page_size, Hkv, D)
        The cache, written in place when ``k_new`` is given (contiguous last axis). ``H`` must
        be a multiple of ``Hkv``: query head ``h`` uses kv head ``h // (H // Hkv)``.
    cache_seqlens : int or int32 array, shape (B,)
        Keys already in each sequence's cache (0 is an empty cache). An int (every sequence
        the same length) is checked against the capacity on the host and needs no device
        array; a CUDA graph bakes it in, so pass an array for a captured decode step whose
        lengths change between replays.
    block_table : int32 array, shape (B, max_pages), optional
        Paged cache: key ``j`` of sequence ``b`` lives at page ``block_table[b, j // page_size]``,
        row ``j % page_size``. On the GPU C-contiguous, as cache_seqlens (a slice
        ``block_table[:, :n]`` of a wider table is refused: pass a copy). The page size (axis 1 of
        the caches) may be any power of two from 16 up (16 is vLLM's; 16 is the decode kernel's key tile, which never
        straddles a page).
    k_new, v_new : array, shape (B, Snew, Hkv, D), optional
        Keys and values to append before attending (both or neither). They are written into
        k_cache and v_cache in place, so with them the caches must be writeable and not
        broadcast views (stride 0 on an axis of size > 1); ValueError otherwise, before
        anything is written.
    causal : bool, optional
        Bottom-right aligned per sequence: query ``i`` sees keys ``j <= i + L_b - Sq`` (the new
        queries are the last Sq positions).
    scale : float, optional
        Default ``1 / sqrt(D)``.
    return_lse : bool, optional
        Also return lse, float32 of shape (B, H, Sq) (natural log).
    out : array or (array, array), optional
        o buffer (B, Sq, H, Dv), or with ``return_lse`` a pair (o, lse); as in `attention`,
        neither a broadcast view nor sharing memory with the other.
    workspace : GPU array, optional
        GPU only. A C-contiguous buffer on the inputs' device of at least
        ``attention_with_kvcache_workspace_size(...)`` bytes (same arguments), starting on a
        256-byte boundary (any fresh CuPy array does); its contents on entry do not matter.
        It holds, in 256-byte aligned sections: with ``k_new``, B int32 lengths (the decode's
        ``cache_seqlens + Snew``, or for an int cache_seqlens the append's start positions);
        then, when the decode splits the keys over s > 1 blocks, the float32 partial outputs
        ``E * s * R * Dpad * 4`` bytes and partial lse ``E * s * R * 4`` bytes, with
        ``E = B * Hkv`` entries, ``R`` packed rows (``G * Sq``, ``G = H / Hkv``, rounded up
        to a multiple of 16, or of 32 when ``G * Sq > 16`` and ``Dpad <= 128``) and ``Dpad``
        the head dim rounded up to 64, 128 or 256 (s is chosen from the problem
        and the SM count). Without it that memory comes from CuPy's memory pool (an
        allocation per call, made on the launch stream). With ``out=`` (o and, with
        ``return_lse``, lse) and ``workspace=`` the call allocates nothing and never
        synchronises, so it can be captured in a CUDA graph (e.g. ``cupy.cuda.Stream``'s
        ``begin_capture``/``end_capture``) and replayed on new contents of the same buffers.
    stream : optional
        GPU only, as in `attention`.
    kernel : {"auto", "decode"}, optional
        GPU only; both run the decode kernel (kernels_cu/attn_decode.cu).

    Returns
    -------
    o : array, shape (B, Sq, H, Dv), q's dtype
    lse : array, shape (B, H, Sq), float32 (only with ``return_lse``)
        A sequence with ``L_b = 0`` gives ``o = 0`` and ``lse = -inf`` (never NaN); so do rows
        that the causal mask leaves without a key. To merge two results (a cache split in two)
        with `merge_states`, pass ``o.transpose(0, 2, 1, 3)`` (B, H, Sq, Dv) with lse as it is:
        o as returned does not match lse's axes (and when ``Sq == H`` the shapes agree but the
        rows would take the wrong weights).

    Raises
    ------
    TypeError, ValueError
        As `attention` for shapes, dtypes and devices, plus: a page size that is not a power of
        two >= 16, block_table or cache_seqlens not int32 or of the wrong shape (on the GPU also not
        C-contiguous: the kernels read them as dense arrays), k_new without v_new. For NumPy inputs
        also lengths beyond the cache's capacity and page numbers
        outside the cache (and an int cache_seqlens out of range for any input). A
        ``workspace`` on NumPy inputs, on another device, not C-contiguous, too small or
        misaligned. GPU inputs: the lengths live on the device and are not read back
        (no synchronisation), so ``cache_seqlens[b] + Snew`` beyond the capacity, or a block
        table naming pages outside the cache, is the caller's error and reads or writes out of
        bounds, as in FlashAttention.
    """
    # A signature (CuPy arrays: shapes, strides, dtypes, devices, alignment; an int
    # cache_seqlens by value; the flags) seen before has passed every check: launch its record
    # (`_kv_hit`) with this call's pointers.
    call = _kv_signature(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, causal,
                         scale, return_lse, out, workspace, kernel)
    if call is not None:
        rec = _kv_lookup(call[0])
        if rec is not None and not _hit_may_overlap(rec, out):
            return _kv_hit(rec, call[1], cache_seqlens, out, workspace, stream)
    prob = check_kvcache(q, k_cache, v_cache, cache_seqlens, block_table=block_table,
                         k_new=k_new, v_new=v_new, causal=causal, scale=scale,
                         return_lse=return_lse, out=out, stream=stream, kernel=kernel,
                         workspace=workspace)
    o, lse = kvcache_numpy(prob) if prob.backend == "cpu" else kvcache_gpu(prob, call)
    return (o, lse) if prob.return_lse else o


def attention_with_kvcache_workspace_size(q, k_cache, v_cache, cache_seqlens, *, block_table=None,
                                          k_new=None, v_new=None, causal=False, kernel="auto"):
    """Bytes of GPU workspace `attention_with_kvcache` needs for these arguments (0 for NumPy
    inputs; the layout is under ``workspace`` there). Validates like `attention_with_kvcache`;
    launches, allocates and synchronises nothing (the size depends on shapes, ``Snew``, an int
    cache_seqlens' value and the device's SM count, never on device contents)."""
    prob = check_kvcache(q, k_cache, v_cache, cache_seqlens, block_table=block_table,
                         k_new=k_new, v_new=v_new, causal=causal, scale=None, return_lse=False,
                         out=None, stream=None, kernel=kernel)
    if prob.backend == "cpu":
        return 0
    from . import _decode

    attrs = _decode.attrs_or_raise(prob, "attention_with_kvcache", [
        prob.q, prob.k_cache, prob.v_cache, prob.k_new, prob.v_new])
    return kvcache_launch(prob, attrs)[2]
