"""cuflash from JAX: `attention` in JAX's layout, under ``jax.jit``, ``jax.vmap`` and ``jax.grad``.

Needs the ``jax`` extra (``pip install "cuflash[jax]"``; for the GPU, a CUDA build of jaxlib and
the ``cuda13``/``cuda12`` extra). This is the only module of cuflash that imports JAX.

Layout. JAX's attention (``jax.nn.dot_product_attention``) takes ``q (..., Sq, H, D)``,
``k (..., Sk, Hk, D)``, ``v (..., Sk, Hk, Dv)``: sequence before heads. cuflash's own functions take
heads before the sequence, ``(..., H, S, D)``, but read rows through strides, so no data is moved:
inside XLA's computation the buffers are viewed as ``(..., Hk, H // Hk, S, D)`` (q, o) and
``(..., Hk, 1, S, D)`` (k, v), and grouped-query attention (``H`` a multiple of ``Hk``) becomes
cuflash's broadcasting over the size-1 axis.

How it runs. Each call is one ``jax.experimental.buffer_callback`` (JAX >= 0.6.1): XLA hands the
callback its own device buffers and, on the GPU, its compute stream; the callback views them as
CuPy arrays (no copy, no host round trip) and calls `cuflash.attention` /
`cuflash.attention_backward` with ``out=`` on that stream, so the kernels run in XLA's order.
On the CPU the same callback views the buffers as NumPy arrays and runs cuflash's NumPy path.
Gradients: ``jax.custom_vjp``, the forward saving ``o`` and ``lse``, the backward one more
buffer callback onto `cuflash.attention_backward`. ``vmap``: the callback is batched with
``vmap_method="expand_dims"`` (the mapped axes become leading batch axes, which cuflash accepts
and broadcasts). The backward's workspace is one more output of its callback (XLA's memory).
``command_buffer=True``: the callbacks are command-buffer compatible, so XLA may capture them
into CUDA graphs and replay them without Python (notes/JAX.md, "Command buffers").
"""
from __future__ import annotations

import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.buffer_callback import buffer_callback

from . import _api, _callcache, _checks, _dispatch, _launch

__all__ = ["attention", "merge_states"]


def attention(q, k, v, *, causal=False, scale=None, precision=None, return_lse=False,
              kernel="auto", deterministic=False, command_buffer=False):
    """Exact scaled-dot-product attention on JAX arrays, ``softmax(scale * q @ k^T) @ v``.

    The same computation and rules as `cuflash.attention` (tiled online softmax, float32
    accumulation, bottom-right causal mask, NaN/inf semantics), in JAX's layout, as a JAX
    operation that composes with ``jax.jit``, ``jax.vmap``, ``jax.grad`` (``jax.custom_vjp`` onto
    `cuflash.attention_backward`) and ``jax.value_and_grad``.

    Parameters
    ----------
    q : jax.Array, shape (..., Sq, H, D)
    k : jax.Array, shape (..., Sk, Hk, D)
    v : jax.Array, shape (..., Sk, Hk, Dv)
        float16, bfloat16, float32 (float64 with ``jax_enable_x64``), one dtype. The layout of
        ``jax.nn.dot_product_attention``: sequence, then heads, then head dim. ``H`` must be a
        multiple of ``Hk`` (``Hk == 1``: multi-query, ``1 < Hk < H``: grouped-query attention,
        query head ``h`` using key/value head ``h // (H // Hk)``). Leading axes ``...`` (at least
        none: 3-D inputs are one batch entry) broadcast NumPy-style. ``1 <= D, Dv <= 256``.
    causal : bool, optional
        Bottom-right aligned mask (query ``i`` sees keys ``j <= i + Sk - Sq``), as in
        `cuflash.attention`; rows that see no key give 0 and ``lse = -inf``.
    scale : float, optional
        Static: a Python number (or a concrete 0-d array, read as its value); default
        ``1 / sqrt(D)``. A traced value (an argument of the jitted or vmapped function) raises
        TypeError: the configuration is fixed when the function is traced. ``causal``,
        ``return_lse``, ``deterministic`` and ``command_buffer`` are static the same way.
    precision : {None, "default", "highest", "high"} or jax.lax.Precision, optional
        float32 product mode, as in `cuflash.attention`.
    return_lse : bool, optional
        Also return ``lse``, float32 of shape ``(..., Sq, H)`` (o's shape without its last
        axis): the natural log of each row's softmax denominator, for `merge_states`. Gradients
        flow through it too (at the cost of one more forward and backward, see Notes).
    kernel : {"auto", "generic", "tensorcore", "hopper"}, optional
        The forward kernel on the GPU, as in `cuflash.attention` (the backward takes
        ``"generic"`` for ``"generic"`` and ``"auto"`` otherwise). Only ``"auto"`` on the CPU:
        without a GPU backend in JAX any other value raises ValueError at trace time.
    deterministic : bool, optional
        Passed to `cuflash.attention_backward`.
    command_buffer : bool, optional
        Let XLA put the GPU callbacks into its command buffers (CUDA graphs):
        ``buffer_callback(..., command_buffer_compatible=True)``. XLA then runs the Python
        callback once under stream capture per set of buffer addresses and replays the captured
        kernels on later calls, so a replayed call costs no Python at all. Whether XLA builds a
        command buffer at all is XLA's choice: it needs ``CUSTOM_CALL`` in
        ``--xla_gpu_enable_command_buffer`` and a sequence of at least
        ``--xla_gpu_graph_min_graph_size`` commands (``XLA_FLAGS``, set before JAX starts;
        notes/JAX.md). While compatible, a callback queues only kernels on XLA's stream and
        takes no memory from CuPy's pool: the backward's workspace is an XLA buffer, the
        decode kernel's split partials a buffer kept per signature; layouts that would need
        temporaries (more than three batch axes that no stride pattern merges; in the backward
        also k and v broadcast along different batch axes) raise RuntimeError when the
        callback runs. No effect on the CPU.

    Returns
    -------
    o : jax.Array, shape (..., Sq, H, Dv), the input dtype
    lse : jax.Array, shape (..., Sq, H), float32
        Only with ``return_lse=True``.

    Raises
    ------
    TypeError, ValueError
        At trace time, for what `cuflash.attention` rejects on these shapes and dtypes (checked
        by its own checks; the messages name the JAX-layout shapes too), for fewer than 3
        dimensions, for ``H`` not a multiple of ``Hk``, for a traced static argument and for a
        GPU kernel without a GPU backend. NumPy inputs are taken as JAX takes them (float64 as
        float32 while ``jax_enable_x64`` is off).

    Notes
    -----
    Nothing is copied: on the GPU the kernels read and write XLA's buffers in place, on XLA's
    stream. The backward's workspace (``delta``, the float32 row statistics or the float32 dq
    accumulator; O(batch x Sq x D)) is one more output of its callback, allocated by XLA and
    discarded. A cotangent on ``lse`` (``dlse``) adds
    ``dlse_i p_ij`` to the score gradient; it costs one more forward (``P k``, for dq) and
    backward (``P^T (dlse q)``, for dk), with ``dlse q`` rounded to the input dtype; the terms
    are summed in float32 (float64 for float64 inputs).

    Reverse mode only (``jax.custom_vjp``): ``jax.jvp`` and ``jax.jacfwd`` raise JAX's
    TypeError at trace time, ``jax.hessian`` (forward over reverse) JAX's ValueError that
    buffer callbacks have no JVP, and ``jax.linear_transpose`` (the op is linear in ``v``)
    JAX's NotImplementedError; ``jax.jacrev``, ``jax.checkpoint`` and ``jax.lax.scan`` compose.
    """
    cfg = _config(q, k, v, causal=causal, scale=scale, precision=precision,
                  return_lse=return_lse, kernel=kernel, deterministic=deterministic,
                  command_buffer=command_buffer)
    # NumPy inputs become JAX arrays (float64 ones float32 while jax_enable_x64 is off), as the
    # checks above took them
    return _attention_fn(cfg)(*(jnp.asarray(x) for x in (q, k, v)))


def merge_states(o_a, lse_a, o_b, lse_b):
    """Combine two attention results over disjoint key sets, in JAX's layout (differentiable).

    The JAX twin of `cuflash.merge_states`, with its checks (at trace time) and its weights:
    ``m = max(lse_a, lse_b)``, ``e = exp(lse - m)``, ``w_a = e_a / (e_a + e_b)``,
    ``lse = m + log(e_a + e_b)``, so the weights depend on ``lse_a - lse_b`` only (weights
    taken as ``exp(lse_a - logaddexp(lse_a, lse_b))`` would carry the merged lse's float32
    rounding, a relative error of about ``6e-8 |lse|`` in every output). A part that saw no
    key (``o = 0, lse = -inf``) is the identity; two such parts give ``o = 0, lse = -inf`` and
    zero gradients (never NaN). Plain ``jax.numpy``: composes with ``jit``, ``vmap`` and
    ``grad`` (forward mode too).

    Parameters
    ----------
    o_a, o_b : jax.Array, shape (..., Sq, H, Dv)
        Partial outputs (as `attention` returns them), one dtype, no zero-length axis.
    lse_a, lse_b : jax.Array, shape (..., Sq, H), float32
        Their log-sum-exps (``attention(..., return_lse=True)``): o's shape without its last
        axis.

    Returns
    -------
    o : jax.Array, shape (..., Sq, H, Dv), the dtype of ``o_a``
    lse : jax.Array, shape (..., Sq, H), float32

    Raises
    ------
    TypeError, ValueError
        At trace time, for what `cuflash.merge_states` rejects (`cuflash._checks.check_merge`
        on the shapes and dtypes).
    """
    items = (("o_a", o_a), ("lse_a", lse_a), ("o_b", o_b), ("lse_b", lse_b))
    _check_arrays(items, min_ndim=0)
    _checks.check_merge(*(_standin(tuple(x.shape), _canonical_dtype(x.dtype)) for _, x in items))
    o_a, lse_a, o_b, lse_b = (jnp.asarray(x) for _, x in items)
    acc = jnp.promote_types(o_a.dtype, jnp.float32)
    la, lb = lse_a.astype(acc), lse_b.astype(acc)
    mx = jnp.maximum(la, lb)
    empty = mx == -jnp.inf
    # The result does not depend on the shift (its derivative is zero): no gradient through it,
    # which also keeps jnp.maximum's tie rule out of the gradients.
    shift = jax.lax.stop_gradient(jnp.where(empty, 0.0, mx))
    ea, eb = jnp.exp(la - shift), jnp.exp(lb - shift)
    tot = jnp.where(empty, 1.0, ea + eb)
    lse = jnp.where(empty, -jnp.inf, shift + jnp.log(tot))
    o = o_a.astype(acc) * (ea / tot)[..., None] + o_b.astype(acc) * (eb / tot)[..., None]
    return o.astype(o_a.dtype), lse.astype(jnp.float32)


# ---------------------------------------------------------------------------------------------
# Trace-time checks: cuflash's own, on NumPy stand-ins of the cuflash-layout views.

_KDLCPU = 1


def _standin(shape, dtype):
    """A NumPy array of `shape` and `dtype` that owns one element (stride 0 elsewhere, last axis
    contiguous as the real views are), for running cuflash's checks on shapes alone."""
    base = np.zeros(shape[-1:], dtype=dtype)
    return np.lib.stride_tricks.as_strided(base, shape, (0,) * (len(shape) - 1) + base.strides)


def _cf_shape(shape, hk):
    """JAX-layout shape (..., S, H, D) -> the cuflash view's (..., hk, H // hk, S, D)."""
    *lead, s, h, d = shape
    return tuple(lead) + (hk, h // hk, s, d)


def _canonical_dtype(dtype):
    """The dtype JAX gives an array of `dtype` (float64 is float32 while ``jax_enable_x64`` is
    off: a NumPy float64 input becomes a float32 JAX array)."""
    return np.dtype(jax.dtypes.canonicalize_dtype(dtype))


def _check_arrays(items, min_ndim=3):
    """`items`: (name, value) pairs that must be arrays (anything with a shape and a dtype: JAX
    arrays and tracers, NumPy arrays) of at least `min_ndim` dimensions."""
    for name, x in items:
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise TypeError(f"{name} must be a JAX array (or array-like with shape and dtype), "
                            f"got {type(x).__name__}")
        if len(x.shape) < min_ndim:
            raise ValueError(f"{name} must have shape (..., S, H, D) (JAX's layout, at least 3 "
                             f"dimensions); got {tuple(x.shape)}")


def _static(name, value):
    """`value` of the static argument `name`, refusing a traced one (a configuration is fixed
    when the function is traced) and reading a concrete 0-d JAX array as its Python scalar."""
    if isinstance(value, jax.core.Tracer):
        raise TypeError(
            f"{name} must be static, a Python value known when the function is traced; got a "
            f"traced JAX value ({type(value).__name__}): pass a Python number or bool, not an "
            f"argument of the jitted, vmapped or differentiated function (close over it, or "
            f"use jax.jit(..., static_argnames=...))")
    if isinstance(value, jax.Array) and value.ndim == 0:
        return value.item()
    return value


@functools.lru_cache(maxsize=None)
def _jax_has_gpu():
    """Whether JAX has a GPU backend; without one the callbacks only ever run on the CPU."""
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


def _config(q, k, v, **kw):
    _check_arrays((("q", q), ("k", k), ("v", v)))
    kw = {name: _static(name, x) for name, x in kw.items()}
    h, hk, hv = q.shape[-2], k.shape[-2], v.shape[-2]
    if hv != hk:
        raise ValueError(f"k has {hk} heads (axis -2) but v has {hv}: they must match")
    if hk and h % hk:
        raise ValueError(f"q has {h} heads and k, v {hk}: the query heads must be a multiple of "
                         "the key/value heads (grouped-query attention)")
    kernel = kw["kernel"]
    # Without a GPU backend the callbacks run the NumPy path, which takes kernel="auto" only.
    _checks._check_kernel(kernel, "gpu" if _jax_has_gpu() else "cpu",
                          where="JAX has no GPU backend here, so the callbacks run cuflash's "
                                "NumPy path on the CPU, which takes kernel='auto' only")
    precision = _checks.check_precision(kw["precision"])
    shapes = f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
    try:
        # (hk = 0: a zero-length axis, which the checks name)
        stand = [_standin(_cf_shape(tuple(x.shape), hk or 1), _canonical_dtype(x.dtype))
                 for x in (q, k, v)]
    except TypeError as exc:
        raise TypeError(f"unsupported dtype among q, k, v ({q.dtype}, {k.dtype}, {v.dtype}): "
                        f"{exc}") from None
    try:
        prob = _checks.check_attention(*stand, causal=kw["causal"], scale=kw["scale"],
                                       return_lse=kw["return_lse"], out=None, stream=None,
                                       kernel="auto", precision=precision)
    except (TypeError, ValueError) as exc:
        # The checks see the cuflash views (..., Hk, H // Hk, S, D): say what the caller passed.
        raise type(exc)(f"{exc} (cuflash.jax.attention checks the JAX-layout inputs {shapes} "
                        "as cuflash views of shape (..., Hk, H // Hk, S, D))") from None
    for name in ("deterministic", "command_buffer"):
        if not isinstance(kw[name], (bool, np.bool_)):
            raise TypeError(f"{name} must be a bool, got {type(kw[name]).__name__}")
    return (bool(kw["causal"]), prob.scale, precision,
            bool(kw["return_lse"]), kernel, bool(kw["deterministic"]), bool(kw["command_buffer"]))


# ---------------------------------------------------------------------------------------------
# The buffer callbacks: XLA buffers -> cuflash views -> cuflash call with out=.

def _platform(ctx, buf):
    """XLA's CUDA stream handle on the GPU, None on the CPU (read from a buffer's DLPack device:
    asking a CPU context for its stream raises, which costs more than the call)."""
    if buf.__dlpack_device__()[0] == _KDLCPU:
        return None
    return ctx.stream


def _as_array(buf, stream):
    """An XLA buffer as a NumPy (CPU) or CuPy (GPU) array, without a copy. On the GPU the array
    is built from the buffer's pointer with the buffer's own dtype: __cuda_array_interface__
    has no bfloat16 type code."""
    if stream is None:
        return np.asarray(buf)
    import cupy

    ptr = buf.__cuda_array_interface__["data"][0]
    dtype = np.dtype(buf.dtype)
    shape = tuple(buf.shape)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    mem = cupy.cuda.UnownedMemory(ptr, nbytes, buf)
    return cupy.ndarray(shape, dtype, cupy.cuda.MemoryPointer(mem, 0))


def _cupy():
    import cupy

    return cupy


def _view(x, hk):
    """(..., S, H, D) -> (..., hk, H // hk, S, D), a view."""
    *lead, s, h, d = x.shape
    nl = len(lead)
    y = x.reshape(tuple(lead) + (s, hk, h // hk, d))
    return y.transpose(tuple(range(nl)) + (nl + 1, nl + 2, nl, nl + 3))


def _lse_view(x, hk):
    """(..., H, Sq) -> (..., hk, H // hk, Sq), a view (C-contiguous)."""
    *lead, h, s = x.shape
    return x.reshape(tuple(lead) + (hk, h // hk, s))


def _forbid_pool(nbytes):
    """CuPy allocator inside a command-buffer-compatible callback: memory from CuPy's pool goes
    back to it when the callback returns, while XLA's replays of the captured kernels still
    use it. (Empty allocations hold no memory and are allowed.)"""
    if nbytes == 0:
        mem = _cupy().cuda.memory
        return mem.MemoryPointer(mem.Memory(0), 0)
    raise RuntimeError(
        f"cuflash.jax.attention(command_buffer=True): this call needs {nbytes} bytes of "
        "temporaries from CuPy's memory pool (inputs whose batch axes no stride pattern "
        "merges; in the backward also k and v broadcast along different batch axes: "
        "notes/JAX.md), which a replayed XLA command buffer would use after the pool handed "
        "them on; call it with command_buffer=False")


def _capturing(stream):
    """Whether `stream` (a CUDA stream handle) is being captured (XLA tracing a command
    buffer)."""
    try:
        return _cupy().cuda.runtime.streamIsCapturing(stream) != 0
    except Exception:  # an older CuPy: assume it is, the careful choice
        return True


def _gpu_call(fn, device_id, stream, cmdbuf, prepare=None):
    """Run `fn()` (cuflash calls) on XLA's `stream` as CuPy's current stream.

    Without command buffers: inline. With them (``command_buffer=True``): `prepare()` (if any)
    first, then `fn()` with CuPy's allocator replaced by one that raises (`_forbid_pool`);
    and when XLA is tracing (`stream` is being captured) both run on a helper thread, which
    enqueues onto the captured stream like the callback would (the capture records work from
    any thread) but is itself outside the capture: XLA captures in thread-local mode, where
    the first call's host work (compiling and loading the kernels through NVRTC and the
    driver, allocating a kept workspace) on the capturing thread could invalidate it."""
    cupy = _cupy()

    def run():
        with cupy.cuda.Device(device_id), _callcache.external_stream(stream, device_id):
            if not cmdbuf:
                fn()
                return
            if prepare is not None:
                prepare()
            with cupy.cuda.using_allocator(_forbid_pool):
                fn()

    if not (cmdbuf and _capturing(stream)):
        run()
        return
    import threading

    err = []

    def target():
        try:
            run()
        except BaseException as exc:  # re-raised on XLA's thread
            err.append(exc)

    t = threading.Thread(target=target, name="cuflash-jax-capture")
    t.start()
    t.join()
    if err:
        raise err[0]


def _fwd_callback(cfg, with_lse):
    causal, scale, precision, _, kernel, _, cmdbuf = cfg
    # GPU: buffer signature (device, shapes, dtypes, pointer alignment) -> the record that
    # cuflash's call cache made for the first call (_callcache): later calls launch it with the
    # pointers of XLA's buffers, skipping the views and the cuflash call around the launch.
    # Under command buffers XLA runs the callback again for every new set of buffer addresses
    # (it traces again): the record then launches with the new pointers, as without them.
    records = {}
    # command_buffer=True: signature -> the workspace its calls use (the decode kernel's split
    # partials; None when the plan needs none), sized for the plan that runs under the
    # dispatcher's tables of `kept_gen[sig]` (_callcache's generation: DECODE_VERSION, the split
    # model's constants, DECODE_MAX_SQ, ...). A full-path call under another generation sizes it
    # again and, when it must grow, replaces it; the replaced ones stay in `retired` for the
    # function's lifetime, as graphs captured before may still replay into them.
    kept, kept_gen, retired = {}, {}, []

    def callback(ctx, out, q, k, v):
        dev = q.__dlpack_device__()
        stream = None if dev[0] == _KDLCPU else ctx.stream
        bufs = (q, k, v) + (tuple(out) if with_lse else (out,))
        if stream is not None:
            # one __cuda_array_interface__ per buffer gives the pointer and the shape (written
            # out: a loop over the buffers cost 1.5 us more)
            cq, ck, cv = (q.__cuda_array_interface__, k.__cuda_array_interface__,
                          v.__cuda_array_interface__)
            pq, pk, pv = cq["data"][0], ck["data"][0], cv["data"][0]
            ob, lb = bufs[3], (bufs[4] if with_lse else None)
            co = ob.__cuda_array_interface__
            po = co["data"][0]
            sig = (dev[1], cq["shape"], q.dtype, pq & 15, ck["shape"], k.dtype, pk & 15,
                   cv["shape"], v.dtype, pv & 15, co["shape"], ob.dtype, po & 15)
            if lb is None:
                pl = 0
            else:
                cl = lb.__cuda_array_interface__
                pl = cl["data"][0]
                sig += (cl["shape"], lb.dtype, pl & 15)
            rec = records.get(sig)
            if rec is not None and rec.valid():
                _launch_record(rec, dev[1], (pq, pk, pv, po, pl), stream,
                               kept.get(sig) if cmdbuf else None)
                return
        hk = k.shape[-2]
        qv, kv, vv = (_view(_as_array(x, stream), hk) for x in (q, k, v))
        if with_lse:
            o = _view(_as_array(bufs[3], stream), hk)
            lse = _lse_view(_as_array(bufs[4], stream), hk)
            res = (o, lse)
        else:
            res = _view(_as_array(out, stream), hk)
        kw = dict(causal=causal, scale=scale, precision=precision, kernel=kernel,
                  return_lse=with_lse, out=res)
        if stream is None:
            _api.attention(qv, kv, vv, **kw)
            return
        # Copies cuflash may make (batch axes that do not merge, as vmap over some arguments
        # with grouped heads gives) must run on XLA's stream too, and come from its pool arena.
        def prepare():
            gen = _callcache._tables()
            if kept_gen.get(sig) == gen:
                return
            need = _api.attention_workspace_size(
                qv, kv, vv, causal=causal, return_lse=with_lse, out=res, kernel=kernel,
                precision=precision)
            have = kept.get(sig)
            if need and (have is None or have.nbytes < need):
                if have is not None:
                    retired.append(have)
                kept[sig] = _cupy().empty(need, dtype=np.uint8)
            elif sig not in kept:
                kept[sig] = None
            kept_gen[sig] = gen

        def call():
            ws = kept[sig] if cmdbuf else None
            _api.attention(qv, kv, vv, stream=stream, workspace=ws, **kw)

        _gpu_call(call, dev[1], stream, cmdbuf, prepare)
        ws = kept[sig] if cmdbuf else None
        rec = _callcache.lookup(_callcache.signature(qv, kv, vv, causal, scale, with_lse, res,
                                                     kernel, precision, ws))
        if rec is not None and (ws is not None or not (cmdbuf and rec.part_bytes)):
            records[sig] = rec
    return callback


def _launch_record(rec, device_id, ptrs, stream, workspace):
    """Launch a call-cache record (dense or decode kernel) with XLA's buffer pointers on XLA's
    `stream` (a handle). The decode kernel's split partials: the signature's kept `workspace`
    under command buffers, else a CuPy pool block taken on XLA's stream (as the full path's
    `_gpu_call` does), which the pool hands on only in that stream's order."""
    cupy = sys.modules.get("cupy") or _cupy()   # (an import statement per call costs more)
    st = _callcache.external_stream(stream, device_id)   # (cached: constructing one, 2.5 us)
    if rec.single or cupy.cuda.runtime.getDevice() == device_id:   # (one device: it is)
        _callcache.launch(rec, ptrs, st, workspace)
        return
    with cupy.cuda.Device(device_id):
        _callcache.launch(rec, ptrs, st, workspace)


def _workspace_view(buf):
    """The XLA workspace buffer as a flat uint8 CuPy array starting on cuflash's workspace
    alignment (XLA's buffers are aligned less; the buffer holds that slack, `_bwd_workspace`)."""
    cupy = _cupy()
    ptr = buf.__cuda_array_interface__["data"][0]
    nbytes = int(np.prod(tuple(buf.shape)))
    a = _launch.WORKSPACE_ALIGN
    skip = -ptr % a
    mem = cupy.cuda.UnownedMemory(ptr + skip, nbytes - skip, buf)
    return cupy.ndarray((nbytes - skip,), cupy.uint8, cupy.cuda.MemoryPointer(mem, 0))


#: Slack in the backward's XLA workspace: the base's alignment (< 256 bytes) and the sections'
#: (< 256 bytes each, three sections), for the workspace of every vmap entry.
_WS_SLACK = 4 * 256


def _bwd_workspace(q, k, v, do):
    """The backward workspace as one more output of its callback, so that XLA owns it (no
    CuPy pool allocation; nothing a command-buffer replay could find handed on): a bound on
    `cuflash.attention_backward_workspace_size` for every backward plan these shapes can take
    (the tensor-core plans' float32 dq accumulator, for 16-bit and float32 inputs, the recomputed
    row max and sum of the float32/float64 plans: both, where they apply), plus alignment slack. It
    is linear in the batch, so under ``vmap`` (which gives it a leading axis) it still bounds."""
    lead = _lead(q, k, v, do)
    nbatch = int(np.prod(lead, dtype=np.int64)) * q.shape[-2]
    dt = np.dtype(q.dtype).name
    row = _dispatch.backward_dq_accum_row_bound(dt, q.shape[-1])
    import types

    bplan = types.SimpleNamespace(lse_acc=True, dq_accum_row=row)
    prob = types.SimpleNamespace(batch_shape=(nbatch,), sq=q.shape[-3], dtype_name=dt)
    return jax.ShapeDtypeStruct((_launch.backward_workspace_bytes(bplan, prob) + _WS_SLACK,),
                                jnp.uint8)


def _bwd_callback(cfg):
    causal, scale, _, _, kernel, deterministic, cmdbuf = cfg
    bkernel = "generic" if kernel == "generic" else "auto"

    def callback(ctx, out, do, q, k, v, o, lse):
        stream = _platform(ctx, q)
        hk = k.shape[-2]
        dq, dk, dv = (_view(_as_array(x, stream), hk) for x in out[:3])
        xs = [_view(_as_array(x, stream), hk) for x in (q, k, v)]
        dov, ov = (_view(_as_array(x, stream), hk) for x in (do, o))
        lsev = _lse_view(_as_array(lse, stream), hk)
        # Under vmap an argument that is not mapped arrives with size-1 leading axes while the
        # gradients are per mapped entry: read it broadcast (stride 0) to the full shape.
        xp = np if stream is None else _cupy()
        xs = [x if x.shape == g.shape else xp.broadcast_to(x, g.shape)
              for x, g in zip(xs, (dq, dk, dv))]
        batch = np.broadcast_shapes(*(x.shape[:-2] for x in (dq, dk, dv, dov, ov)),
                                    lsev.shape[:-1])
        dov, ov = (x if x.shape[:-2] == batch else xp.broadcast_to(x, batch + x.shape[-2:])
                   for x in (dov, ov))
        if lsev.shape[:-1] != batch:
            lsev = xp.broadcast_to(lsev, batch + lsev.shape[-1:])
        kw = dict(causal=causal, scale=scale, deterministic=deterministic, kernel=bkernel,
                  out=(dq, dk, dv))
        if stream is None:
            _api.attention_backward(dov, *xs, ov, lsev, **kw)
            return
        # The workspace is XLA's (out[3]). Temporaries of the rare layouts that need them come
        # from CuPy's pool, which hands a freed block only to later work on the stream it was
        # allocated under: XLA's stream (command_buffer=True forbids them, _gpu_call).
        ws = _workspace_view(out[3])
        _gpu_call(lambda: _api.attention_backward(dov, *xs, ov, lsev, stream=stream,
                                                  workspace=ws, **kw),
                  q.__dlpack_device__()[1], stream, cmdbuf)
    return callback


def _lead(*xs):
    return tuple(np.broadcast_shapes(*(tuple(x.shape[:-3]) for x in xs)))


def _forward(cfg, q, k, v, with_lse):
    lead = _lead(q, k, v)
    sq, h = q.shape[-3], q.shape[-2]
    o_t = jax.ShapeDtypeStruct(lead + (sq, h, v.shape[-1]), q.dtype)
    opts = dict(vmap_method="expand_dims", command_buffer_compatible=cfg[6])
    if not with_lse:
        return buffer_callback(_fwd_callback(cfg, False), o_t, **opts)(q, k, v), None
    lse_t = jax.ShapeDtypeStruct(lead + (h, sq), jnp.float32)
    o, lse = buffer_callback(_fwd_callback(cfg, True), (o_t, lse_t), **opts)(q, k, v)
    return o, lse


def _backward(cfg, do, q, k, v, o, lse):
    shapes = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v)) \
        + (_bwd_workspace(q, k, v, do),)
    dq, dk, dv, _ = buffer_callback(_bwd_callback(cfg), shapes, vmap_method="expand_dims",
                                    command_buffer_compatible=cfg[6])(do, q, k, v, o, lse)
    return dq, dk, dv


@functools.lru_cache(maxsize=None)
def _attention_fn(cfg):
    """The custom_vjp function of (q, k, v) for one static configuration."""
    return_lse = cfg[3]

    @jax.custom_vjp
    def f(q, k, v):
        o, lse = _forward(cfg, q, k, v, return_lse)
        return (o, jnp.swapaxes(lse, -1, -2)) if return_lse else o

    def fwd(q, k, v):
        q, k, v = q.value, k.value, v.value
        o, lse = _forward(cfg, q, k, v, True)
        res = (q, k, v, o, lse)
        return ((o, jnp.swapaxes(lse, -1, -2)) if return_lse else o), res

    def bwd(res, g):
        q, k, v, o, lse = res
        do, dlse = g if return_lse else (g, None)
        if isinstance(do, jax.custom_derivatives.SymbolicZero):
            do = None
        if dlse is not None and not isinstance(dlse, jax.custom_derivatives.SymbolicZero):
            return _backward_with_dlse(cfg, do, dlse, q, k, v, o, lse)
        if do is None:
            return tuple(jnp.zeros(x.shape, x.dtype) for x in (q, k, v))
        return _backward(cfg, do.astype(o.dtype), q, k, v, o, lse)

    f.defvjp(fwd, bwd, symbolic_zeros=True)
    return f


def _backward_with_dlse(cfg, do, dlse, q, k, v, o, lse):
    """Gradients with a cotangent on lse too. d lse_i / d s_ij = p_ij, so the score gradient
    gains ``dlse_i p_ij``: dq gains ``scale dlse_i sum_j p_ij k_j``, a forward attention with
    v = k, and dk gains ``scale sum_i p_ij dlse_i q_i``, the ``P^T do`` (dv) of a backward with
    do = dlse q and v = k. (cuflash's backward recomputes delta = sum_j p_ij dP_ij for float32
    and float64, so the extra term cannot ride in an extra column of v and do.)"""
    scale = cfg[1]
    dt = o.dtype
    if do is None:  # only lse is differentiated
        dq, dk, dv = (jnp.zeros(x.shape, x.dtype) for x in (q, k, v))
    else:
        dq, dk, dv = _backward(cfg, do.astype(dt), q, k, v, o, lse)
    # float32 sums for 16-bit and float32 inputs, float64 for float64 (as cuflash accumulates)
    acc = jnp.promote_types(dt, jnp.float32)
    o_kk, _ = _forward(cfg, q, k, k, False)
    dlse_col = dlse.astype(acc)[..., None]
    dq_lse = scale * dlse_col * o_kk.astype(acc)
    _, _, pt_dlse_q = _backward(cfg, (dlse_col * q.astype(acc)).astype(dt), q, k, k, o_kk, lse)
    dq = (dq.astype(acc) + dq_lse).astype(dt)
    dk = (dk.astype(acc) + scale * pt_dlse_q.astype(acc)).astype(dt)
    return dq, dk, dv
