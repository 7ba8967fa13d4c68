"""`attention_varlen_backward`: gradients of `attention_varlen` over a packed batch of
variable-length sequences (notes/INFERENCE.md, "attention_varlen_backward").

Same stages as `attention_backward`: `check_varlen_backward` (once, before any launch) -> a
`VarlenBackwardProblem` -> `varlen_backward_plan_for` (the dense backward's plans, each kernel
swapped for its ``_varlen`` twin: `_dispatch.varlen_backward_plan`) -> `_compile.get_kernel` ->
`launch_varlen_backward`. The twins run the dense kernels' bodies unchanged on a *segment view*
of the parameter block (kernels_cu/common.cuh: bwd_varlen_segment): the grids cover
max_seqlen_q rows / max_seqlen_k keys per sequence, each block moves the pointers to its
sequence's rows through ``BwdParams.cu_q``/``cu_k`` and takes that sequence's lengths, and blocks
past their sequence leave at once. The CPU path runs the NumPy backward per sequence.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Optional

import numpy as np

from . import _checks, _interop
from ._varlen import VarlenProblem, check_varlen

VARLEN_BACKWARD_KERNELS = ("auto", "generic", "tensorcore")
#: Static shared memory of the generic and tensor-core twins: the segment view, one BwdParams
#: (common.cuh: bwd_varlen_segment_shared), besides the plan's dynamic shared memory.
SEGMENT_VIEW_BYTES = 68 * 8


@dataclass
class VarlenBackwardProblem(VarlenProblem):
    """The forward's `VarlenProblem` (its q, k, v, offsets, sizes and options) plus what the
    backward reads and writes (``return_lse``, ``out`` and ``out_lse`` are unused)."""

    o: Any = None
    do: Any = None
    lse: Any = None
    deterministic: bool = False
    out_grads: Any = None

    # The dense backward's workspace rule (_launch.backward_workspace_bytes) on the packed rows:
    # delta and the row statistics hold (H, total_q), the dq accumulator (H, total_q, row).
    @property
    def batch_shape(self):
        return (self.h,)

    @property
    def sq(self):
        return int(self.q.shape[0])


def check_varlen_backward(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                          max_seqlen_k, *, causal, scale, deterministic, out, workspace, stream,
                          kernel) -> VarlenBackwardProblem:
    """Validate `attention_varlen_backward`'s arguments (no launch, no synchronisation): q, k, v,
    the offsets and max_seqlen as `attention_varlen` checks them; o and do (total_q, H, Dv) in
    the inputs' dtype, lse (H, total_q) float32, on the inputs' device; ``out`` a triple of
    buffers of q's, k's and v's shapes."""
    if kernel not in VARLEN_BACKWARD_KERNELS:
        raise ValueError(f"kernel must be one of {VARLEN_BACKWARD_KERNELS}, got {kernel!r}")
    fwd = check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                       causal=causal, scale=scale, return_lse=False, out=None, stream=None,
                       kernel="auto")
    backend, device_id, dt = fwd.backend, fwd.device_id, fwd.dtype_name
    if backend == "cpu" and kernel != "auto":
        raise ValueError(f"kernel={kernel!r} selects a GPU kernel, but the inputs are on the CPU "
                         "(NumPy); pass GPU arrays or kernel='auto'")
    total_q = int(fwd.q.shape[0])
    arrays = _checks._check_forward_results(o, do, lse, (total_q, fwd.h, fwd.dv),
                                            (fwd.h, total_q), dt, backend, device_id,
                                            "attention_varlen")
    if not isinstance(deterministic, (bool, np.bool_)):
        raise TypeError(f"deterministic must be a bool, got {type(deterministic).__name__}")
    grads = None
    if out is not None:
        shapes = tuple(tuple(x.shape) for x in (fwd.q, fwd.k, fwd.v))
        grads = _checks.check_grad_buffers(out, shapes, dt, backend, device_id)
    if stream is not None and backend == "cpu":
        raise ValueError("stream= applies to GPU inputs only; the inputs are NumPy arrays")
    workspace = _checks.check_workspace(workspace, backend, device_id)
    o, do = arrays["o"], arrays["do"]
    if backend == "gpu":   # lse is read through its strides; the others by rows
        o, do = (_interop.last_axis_contiguous(x) for x in (o, do))
    kw = {f.name: getattr(fwd, f.name) for f in fields(fwd)}
    kw.update(workspace=workspace, stream=stream, kernel=kernel)
    return VarlenBackwardProblem(**kw, o=o, do=do, lse=arrays["lse"],
                                 deterministic=bool(deterministic), out_grads=grads)


def _segment_heads(x, hkv, lo, hi):
    """Rows lo:hi of a packed (total, H, C) array as (Hkv, H / Hkv, hi - lo, C)."""
    t = x[lo:hi].transpose(1, 0, 2)
    return t.reshape(hkv, t.shape[0] // hkv, hi - lo, t.shape[2])


def varlen_backward_numpy(prob):
    """The CPU path: the NumPy backward (`_cpu_backward.attention_backward_numpy`) per sequence,
    its query heads split into (Hkv, group) so that dk, dv sum over the group. Rows of no
    sequence, and of sequences with no key or no query, get zero gradients. Every input is read
    before the ``out`` buffers are written (they may alias do, q, k, v or o)."""
    from ._cpu_backward import attention_backward_numpy

    dq, dk, dv = (np.zeros(x.shape, dtype=x.dtype) for x in (prob.q, prob.k, prob.v))
    for s in range(prob.nseq):
        q0, q1 = int(prob.cu_q[s]), int(prob.cu_q[s + 1])
        k0, k1 = int(prob.cu_k[s]), int(prob.cu_k[s + 1])
        if q1 == q0 or k1 == k0:
            continue
        lse = prob.lse[:, q0:q1].reshape(prob.hkv, prob.h // prob.hkv, q1 - q0)
        gq, gk, gv = attention_backward_numpy(
            _segment_heads(prob.do, prob.hkv, q0, q1), _segment_heads(prob.q, prob.hkv, q0, q1),
            _segment_heads(prob.k, prob.hkv, k0, k1), _segment_heads(prob.v, prob.hkv, k0, k1),
            _segment_heads(prob.o, prob.hkv, q0, q1), lse, causal=prob.causal, scale=prob.scale)
        dq[q0:q1] = gq.reshape(prob.h, q1 - q0, prob.d).transpose(1, 0, 2)
        dk[k0:k1] = gk.reshape(prob.hkv, k1 - k0, prob.d).transpose(1, 0, 2)
        dv[k0:k1] = gv.reshape(prob.hkv, k1 - k0, prob.dv).transpose(1, 0, 2)
    if prob.out_grads is None:
        return dq, dk, dv
    for buf, g in zip(prob.out_grads, (dq, dk, dv)):
        buf[...] = g
    return tuple(prob.out_grads)


@dataclass
class _Desc:
    """What `_dispatch.bwd_tensorcore_reason` reads of a problem, without its arrays (the packed
    layout's alignment is checked by `varlen_tensorcore_reason`)."""

    backend: str
    dtype_name: str
    d: int
    dv: int


def varlen_tensorcore_reason(prob, compute_capability) -> Optional[str]:
    """Why the tensor-core backward cannot run this varlen problem, or None if it can."""
    from . import _dispatch

    why = _dispatch.bwd_tensorcore_reason(_Desc(prob.backend, prob.dtype_name, prob.d, prob.dv),
                                          compute_capability)
    if why is not None:
        return why
    bufs = [prob.q, prob.k, prob.v, prob.do] + list((prob.out_grads or (None,))[1:])
    if not all(_dispatch._aligned16(x) for x in bufs if x is not None):
        return "every row of q, k, v, do (and of the dk, dv buffers) must start on a 16-byte boundary"
    return None


def varlen_backward_plan_for(prob, compute_capability):
    """The dense backward's choice (`_dispatch.backward_plan_for`'s rule) in its varlen form."""
    from . import _dispatch

    if prob.kernel in ("auto", "tensorcore"):
        why = varlen_tensorcore_reason(prob, compute_capability)
        if why is None:
            return _dispatch.varlen_backward_plan(_dispatch.bwd_tensorcore_plan(
                prob.dtype_name, prob.d, prob.causal, prob.deterministic, compute_capability))
        if prob.kernel == "tensorcore":
            raise ValueError(f"kernel='tensorcore' cannot run this backward: {why}")
    return _dispatch.varlen_backward_plan(
        _dispatch.bwd_generic_plan(prob.dtype_name, prob.d, prob.dv, prob.causal))


def varlen_backward_params(bplan, prob, dq, dk, dv, base):
    """(the `BwdParams` record, [(Plan, grid blocks)]) of a GPU `VarlenBackwardProblem`, the
    workspace at device address `base` (`_launch.backward_workspace_bytes` bytes).

    Batch (B, Hkv, G) with batch stride 0 on axis 0 (the sequence: rows come from cu_q/cu_k),
    query head h = (kv head, group member); sq, sk = max_seqlen_q/k. delta holds (H, total_q)
    and lse_acc 2 (H, total_q) elements, in per-sequence sections (bwd_varlen_segment); the dq
    accumulator (H, total_q, dq_accum_row)."""
    from . import _launch

    g = prob.h // prob.hkv
    total_q = prob.sq
    p = np.zeros((), dtype=_launch.BWD_PARAMS_DTYPE)
    for name, x in zip(("q", "k", "v", "o", "dout", "lse", "dq", "dk", "dv"),
                       (prob.q, prob.k, prob.v, prob.o, prob.do, prob.lse, dq, dk, dv)):
        p[name] = x.data.ptr
    p["cu_q"], p["cu_k"] = prob.cu_q.data.ptr, prob.cu_k.data.ptr
    acc = _launch._acc_bytes(prob.dtype_name)
    section = _launch._align(prob.h * total_q * acc)
    p["delta"] = base
    p["lse_acc"] = base + section if bplan.lse_acc else 0
    if bplan.dq_accum_row:
        row = bplan.dq_accum_row
        p["dq_accum"] = base + section + (_launch._align(2 * prob.h * total_q * acc)
                                          if bplan.lse_acc else 0)
        p["dqa_s0"], p["dqa_s1"], p["dqa_s2"], p["dqa_sr"] = 0, g * total_q * row, total_q * row, row
    for name, x in (("q", prob.q), ("o", prob.o), ("do", prob.do), ("dq", dq)):
        st = [s // x.itemsize for s in x.strides]
        p[f"{name}_s0"], p[f"{name}_s1"], p[f"{name}_s2"], p[f"{name}_sr"] = 0, g * st[1], st[1], st[0]
    for name, x in (("k", prob.k), ("v", prob.v), ("dk", dk), ("dv", dv)):
        st = [s // x.itemsize for s in x.strides]
        p[f"{name}_s0"], p[f"{name}_s1"], p[f"{name}_s2"], p[f"{name}_sr"] = 0, st[1], 0, st[0]
    st = [s // 4 for s in prob.lse.strides]
    p["lse_s0"], p["lse_s1"], p["lse_s2"], p["lse_sr"] = 0, g * st[0], st[0], st[1]
    p["sq"], p["sk"], p["d"], p["dv_dim"] = prob.max_q, prob.max_k, prob.d, prob.dv
    p["nb0"], p["nb1"], p["nb2"] = prob.nseq, prob.hkv, g
    p["q_red"], p["kv_red"] = 0, (4 if g > 1 else 0)
    n_mblocks, n_nblocks = -(-prob.max_q // bplan.block_m), -(-prob.max_k // bplan.block_n)
    p["n_mblocks"], p["n_nblocks"] = n_mblocks, n_nblocks
    p["deterministic"] = int(prob.deterministic)
    p["scale_log2"], p["scale"] = prob.scale * _launch._LOG2E, prob.scale
    q_owners, kv_owners = prob.nseq * prob.h, prob.nseq * prob.hkv
    launches = [(bplan.preprocess, -(-prob.max_q // bplan.preprocess.block_m) * q_owners)]
    for kind, plan in bplan.passes:
        grid = {"rows": n_mblocks * q_owners, "keys": n_nblocks * kv_owners,
                "dq_convert": -(-prob.max_q // plan.block_m) * q_owners}[kind]
        launches.append((plan, grid))
    return p[()], launches


def launch_varlen_backward(bplan, prob, dq, dk, dv, attrs):
    """Check every launch of `bplan` on the host, then launch them in order on the call's
    stream (workspace: the caller's, or a pool allocation on that stream). Never synchronises."""
    import cupy

    from . import _compile, _launch

    if max(prob.max_q, prob.max_k, prob.sq, int(prob.k.shape[0])) >= 2**31 - 1024:
        raise ValueError("max_seqlen and the packed row counts must be below 2**31 - 1024")
    need = _launch.backward_workspace_bytes(bplan, prob)
    st = _launch._stream_ptr(prob.stream)
    ws = prob.workspace
    if ws is None:
        with st:
            ws = cupy.empty(need, dtype=cupy.uint8)
    base = _launch.workspace_base(ws, need, "attention_varlen_backward_workspace_size")
    params, launches = varlen_backward_params(bplan, prob, dq, dk, dv, base)
    for plan, grid in launches:
        if grid > _launch.MAX_GRID_X:
            raise ValueError(f"{plan.label}: {grid} blocks is too many for one launch "
                             f"(at most {_launch.MAX_GRID_X})")
        smem = plan.smem_bytes + SEGMENT_VIEW_BYTES
        if smem > attrs["max_smem_optin"]:
            raise ValueError(f"{plan.label} needs {smem} bytes of shared memory per block; this "
                             f"GPU allows {attrs['max_smem_optin']}")
    for plan, grid in launches:
        kern = _compile.get_kernel(plan.spec, prob.device_id, plan.smem_bytes)
        kern((grid,), (plan.threads,), (params,), shared_mem=plan.smem_bytes, stream=st)


def varlen_backward_gpu(prob):
    import cupy

    from . import _launch

    with cupy.cuda.Device(prob.device_id):
        attrs = _launch.device_attributes(prob.device_id)
        bplan = varlen_backward_plan_for(prob, attrs["compute_capability"])
        if prob.out_grads is not None:
            dq, dk, dv = prob.out_grads
        else:
            with _launch._stream_ptr(prob.stream):
                dq, dk, dv = (cupy.empty(x.shape, dtype=x.dtype)
                              for x in (prob.q, prob.k, prob.v))
        launch_varlen_backward(bplan, prob, dq, dk, dv, attrs)
    return dq, dk, dv


def attention_varlen_backward(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                              max_seqlen_k, *, causal=False, scale=None, deterministic=False,
                              out=None, workspace=None, stream=None, kernel="auto"):
    """Gradients of `attention_varlen`: ``(dq, dk, dv)`` in the packed layouts.

    Per sequence, the mathematics and conventions of `attention_backward` (notes/BACKWARD.md):
    ``delta = rowsum(do * o)``, P recomputed from q, k and the forward's lse (float16,
    bfloat16; float32 and float64 recompute each row's max and sum), dq accumulated in float32
    (float64 for float64 inputs).

    Parameters
    ----------
    do : array, shape (total_q, H, Dv)
        The upstream gradient, o's shape and dtype.
    q : array, shape (total_q, H, D)
    k : array, shape (total_k, Hkv, D)
    v : array, shape (total_k, Hkv, Dv)
    cu_seqlens_q, cu_seqlens_k : int32 array, shape (B + 1,)
    max_seqlen_q, max_seqlen_k : int
        The forward's arguments, as in `attention_varlen` (same checks; on the GPU the offsets
        are not read back, and max_seqlen may be upper bounds).
    o : array, shape (total_q, H, Dv)
    lse : array, shape (H, total_q), float32
        What ``attention_varlen(q, k, v, ..., causal=causal, scale=scale, return_lse=True)``
        returned (any strides).
    causal : bool, optional
        As in the forward (bottom-right aligned per sequence). Query rows that see no key
        (also every row of a sequence with no key) get zero gradient, never NaN.
    scale : float, optional
        Default ``1 / sqrt(D)``.
    deterministic : bool, optional
        Bitwise-identical results from run to run: as in `attention_backward` (the tensor-core
        backward then orders its dq additions; the generic one and the CPU path always are).
    out : (dq, dk, dv), optional
        Buffers of q's, k's and v's shapes and dtype on the inputs' device (all three),
        contiguous last axes, no overlapping elements, no two sharing memory (ValueError).
    workspace : GPU array, optional
        GPU only. A C-contiguous, 256-byte aligned buffer of at least
        ``attention_varlen_backward_workspace_size(...)`` bytes: delta (H x total_q, float32;
        float64 for float64), for float32/float64 also the recomputed row max and sum (twice
        that), and for the tensor-core backward the float32 dq accumulator (H x total_q x
        (padded D + 16)). Without it that memory comes from CuPy's pool on the launch stream.
        With ``out=`` and ``workspace=`` the call allocates nothing.
    stream : cupy.cuda.Stream, torch.cuda.Stream or int, optional
        GPU only: the stream to launch on. Never synchronises.
    kernel : {"auto", "generic", "tensorcore"}, optional
        GPU only, as in `attention_backward`: ``"auto"`` takes the tensor-core backward
        (sm_80+, float16/bfloat16, D == Dv, D % 8 == 0, D <= 128, 16-byte aligned rows) where it
        applies, else the generic one (every dtype, D up to 256).

    Returns
    -------
    dq : array, shape (total_q, H, D)
    dk : array, shape (total_k, Hkv, D)
    dv : array, shape (total_k, Hkv, Dv)
        The inputs' dtype; dk and dv of kv head ``j`` sum over its ``H // Hkv`` query heads.
        Rows past ``cu_seqlens_q[-1]`` (keys past ``cu_seqlens_k[-1]``) belong to no sequence:
        0 on the CPU, left unwritten on the GPU (as the forward leaves them).

    Raises
    ------
    TypeError, ValueError
        What `attention_varlen` rejects, plus o, do or lse of the wrong shape, dtype or device,
        a non-bool ``deterministic``, ``out`` not a triple of valid buffers, a ``workspace``
        too small, misaligned or on another device, and (kernel="tensorcore") inputs that the
        tensor-core backward cannot take.
    """
    prob = check_varlen_backward(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                 max_seqlen_k, causal=causal, scale=scale,
                                 deterministic=deterministic, out=out, workspace=workspace,
                                 stream=stream, kernel=kernel)
    if prob.backend == "cpu":
        return varlen_backward_numpy(prob)
    return varlen_backward_gpu(prob)


def attention_varlen_backward_workspace_size(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k,
                                             max_seqlen_q, max_seqlen_k, *, causal=False,
                                             deterministic=False, kernel="auto"):
    """Bytes of GPU workspace `attention_varlen_backward` needs for these arguments (0 for NumPy
    inputs). Validates like it; launches, allocates and synchronises nothing."""
    prob = check_varlen_backward(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                 max_seqlen_k, causal=causal, scale=None,
                                 deterministic=deterministic, out=None, workspace=None,
                                 stream=None, kernel=kernel)
    if prob.backend == "cpu":
        return 0
    from . import _launch

    cc = _launch.device_attributes(prob.device_id)["compute_capability"]
    return _launch.backward_workspace_bytes(varlen_backward_plan_for(prob, cc), prob)


def varlen_backward_dispatch_info(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                  max_seqlen_k, *, causal=False, deterministic=False,
                                  kernel="auto"):
    """The backward plan `attention_varlen_backward` would run (``"cpu-numpy"`` on the CPU), e.g.
    ``"varlen-tensorcore-bwd<float16,D64,BM64,BN64,full>"``. Validates like it."""
    prob = check_varlen_backward(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                 max_seqlen_k, causal=causal, scale=None,
                                 deterministic=deterministic, out=None, workspace=None,
                                 stream=None, kernel=kernel)
    if prob.backend == "cpu":
        return "cpu-numpy"
    from . import _launch

    cc = _launch.device_attributes(prob.device_id)["compute_capability"]
    return varlen_backward_plan_for(prob, cc).label
