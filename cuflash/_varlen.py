"""`attention_varlen`: attention over a packed batch of variable-length sequences
(FlashAttention's ``cu_seqlens`` interface; notes/INFERENCE.md).

q ``(total_q, H, D)``, k ``(total_k, Hkv, D)``, v ``(total_k, Hkv, Dv)``; sequence ``s`` is rows
``cu_seqlens_q[s] .. cu_seqlens_q[s + 1] - 1`` of q and ``cu_seqlens_k[s] ..`` of k and v. o
``(total_q, H, Dv)``, lse ``(H, total_q)`` (FlashAttention's softmax_lse layout). Two GPU paths
(`varlen_plan_for` picks one): the decode kernel family with per-sequence row and key offsets
(kernels_cu/attn_decode.cu: cu_q, cu_k), for decode-like calls, and the dense mma.sync forward's
``_varlen`` twin (kernels_cu/attn_mma.cu: cuflash_fwd_mma_varlen, the plain body on the segment
view of its block's sequence, common.cuh: fwd_varlen_segment), for prefill. The CPU path runs the
NumPy recurrence per sequence.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from . import _checks, _interop
from ._kvcache import (CallOptions, _int32_array, check_call_options, into_out, into_out_lse,
                       one_sequence_numpy)

VARLEN_KERNELS = ("auto", "decode", "tensorcore", "hopper")

#: Whether ``attention_varlen(kernel="auto")`` takes a dense forward's varlen twin for
#: prefill-like calls (`decode_like` false): the mma.sync one (cuflash_fwd_mma_varlen), or on
#: sm_90 with VARLEN_HOPPER_AUTO the Hopper one (cuflash_fwd_wgmma_varlen). On since the complete
#: GPU suite passed with it on the H200 (2026-12-02, session i); the twins ran at 295 (mma.sync)
#: and 511-560 (Hopper) TFLOP/s against the decode family's 161 (session g, call 3).
#: ``kernel="decode"`` / ``"tensorcore"`` / ``"hopper"`` select a family regardless.
VARLEN_DENSE_AUTO = True
#: Whether auto's dense choice (VARLEN_DENSE_AUTO) prefers the Hopper twin where it can run.
VARLEN_HOPPER_AUTO = True
#: Work slots (query blocks, or causal pairs of them) that a block of the Hopper twin walks within
#: one sequence and head (attn_wgmma.cu: cuflash_fwd_wgmma_varlen, vl.group): 1 is one slot a
#: block (session g's measured twin); 2 or more make the block persistent over consecutive slots of
#: its sequence, so the next slot's Q and first K/V tiles load while the current one finishes, and
#: the per-block start (barriers, finding the slot's owner, the first loads) is paid once a group.
#: 4 since the complete GPU suite passed with it (H200, 2026-12-02, session i); session g's call 3
#: measured G = 1 / 2 / 4 at 511 / 504 / 560 TFLOP/s (bench_inference.py --varlen-impl).
VARLEN_HOPPER_GROUP = 4


@dataclass
class VarlenProblem(CallOptions):
    backend: str
    device_id: Optional[int]
    q: Any
    k: Any
    v: Any
    cu_q: Any
    cu_k: Any
    max_q: int
    max_k: int
    dtype_name: str
    nseq: int
    h: int
    hkv: int
    d: int
    dv: int


def check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal,
                 scale, return_lse, out, stream, kernel, workspace=None) -> VarlenProblem:
    """Validate `attention_varlen`'s arguments (no launch, no device synchronisation)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        _checks._refuse_subclass(name, x)
    backends = [_interop.backend_of(x, n) for x, n in ((q, "q"), (k, "k"), (v, "v"))]
    if len(set(backends)) != 1:
        raise ValueError("q, k and v must be on the same device; got " + ", ".join(
            f"{n} on {_interop.describe(*b)}" for n, b in zip("qkv", backends)))
    backend, device_id = backends[0]
    q, k, v = (_interop.as_backend_array(x, backend) for x in (q, k, v))
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 3:
            raise ValueError(f"{name} must have shape (total_tokens, heads, head_dim); got "
                             f"{tuple(x.shape)}")
        if 0 in x.shape:
            raise ValueError(f"{name} has a zero-length axis: shape {tuple(x.shape)}")
    names = [_checks._check_array_dtype(n, x) for n, x in (("q", q), ("k", k), ("v", v))]
    if len(set(names)) != 1:
        raise TypeError(f"q, k and v must have the same dtype; got {', '.join(names)}")
    dt = names[0]
    total_q, h, d = (int(n) for n in q.shape)
    total_k, hkv, dk = (int(n) for n in k.shape)
    if tuple(v.shape[:2]) != (total_k, hkv):
        raise ValueError(f"v has shape {tuple(v.shape)}; expected ({total_k}, {hkv}, Dv) like k")
    dv = int(v.shape[2])
    _checks.check_packed_heads("k", "v", h, hkv, d, dk, dv)
    cu_q = _int32_array("cu_seqlens_q", cu_seqlens_q, backend, device_id, "(B + 1,)", 1)
    cu_k = _int32_array("cu_seqlens_k", cu_seqlens_k, backend, device_id, "(B + 1,)", 1)
    if cu_q.shape[0] != cu_k.shape[0] or cu_q.shape[0] < 2:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must both have B + 1 >= 2 entries; got "
                         f"{cu_q.shape[0]} and {cu_k.shape[0]}")
    for name, m in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(m, bool) or not isinstance(m, numbers.Integral) or m < 1:
            raise ValueError(f"{name} must be a positive int, got {m!r}")
    if backend == "cpu":  # offsets on the host: check them (the GPU path trusts them, see docs)
        for name, cu, total, mx in (("cu_seqlens_q", cu_q, total_q, max_seqlen_q),
                                    ("cu_seqlens_k", cu_k, total_k, max_seqlen_k)):
            lens = np.diff(cu)
            if cu[0] != 0 or (lens < 0).any() or cu[-1] > total:
                raise ValueError(f"{name} must start at 0, not decrease and end at most at "
                                 f"{total} (the rows of its tensor); got {cu.tolist()}")
            if lens.max() > mx:
                raise ValueError(f"a sequence has {lens.max()} rows in {name}, more than "
                                 f"max_seqlen {mx}")
    scale, out_o, out_lse, workspace = check_call_options(
        causal=causal, return_lse=return_lse, scale=scale, d=d, dt=dt, kernel=kernel,
        choices=VARLEN_KERNELS, backend=backend, device_id=device_id, stream=stream, out=out,
        o_shape=(total_q, h, dv), lse_shape=(h, total_q), workspace=workspace)
    if backend == "gpu":
        q, k, v = (_interop.last_axis_contiguous(x) for x in (q, k, v))
    return VarlenProblem(backend, device_id, q, k, v, cu_q, cu_k, int(max_seqlen_q),
                         int(max_seqlen_k), dt, int(cu_q.shape[0]) - 1, h, hkv, d, dv,
                         causal=bool(causal), scale=scale, return_lse=bool(return_lse),
                         out=out_o, out_lse=out_lse, stream=stream, kernel=kernel,
                         workspace=workspace)


def varlen_numpy(prob):
    """The CPU path: the NumPy recurrence per sequence; rows of no sequence are left 0. Every
    input is read before ``out`` is written (an out= buffer may alias q, k or v)."""
    total_q = prob.q.shape[0]
    o = np.zeros((total_q, prob.h, prob.dv), dtype=prob.q.dtype)
    lse = np.full((prob.h, total_q), -np.inf, dtype=np.float32)
    for s in range(prob.nseq):
        q0, q1 = int(prob.cu_q[s]), int(prob.cu_q[s + 1])
        k0, k1 = int(prob.cu_k[s]), int(prob.cu_k[s + 1])
        if q1 > q0 and k1 > k0:
            o[q0:q1], lse[:, q0:q1] = one_sequence_numpy(
                prob.q[q0:q1], prob.k[k0:k1], prob.v[k0:k1], causal=prob.causal, scale=prob.scale)
    return into_out(prob, o), into_out_lse(prob, lse)


def decode_like(prob) -> bool:
    """Whether a varlen call is decode-like (few query rows a sequence: `attention`'s rule for the
    decode kernel, `_decode.DECODE_MAX_SQ` rows and at most `_decode.DECODE_MAX_ROWS` packed rows
    of a head group), which ``kernel="auto"`` keeps on the decode kernel family. Unlike
    `attention`'s rule it keeps causal calls there too (the documented varlen behaviour)."""
    from . import _decode

    return (prob.max_q <= _decode.DECODE_MAX_SQ
            and prob.h // prob.hkv * prob.max_q <= _decode.DECODE_MAX_ROWS)


def dense_reason(prob, compute_capability) -> Optional[str]:
    """Why the dense mma.sync varlen forward cannot run a GPU `VarlenProblem`, or None. Beyond
    the checks every GPU varlen call passes (`_decode.cache_reason`: sm_80+, float16/bfloat16,
    D == Dv, D % 8 == 0, positive scale, 16-byte aligned rows): a head dim the kernel has
    (<= 256), and max_seqlen below 2^31 - 1024 (the kernels' int row indices)."""
    from . import _dispatch

    if prob.d > max(_dispatch.TC_CONFIGS):
        return f"it takes head dims up to {max(_dispatch.TC_CONFIGS)} (got {prob.d})"
    if max(prob.max_q, prob.max_k) >= 2**31 - 1024:
        return "max_seqlen_q and max_seqlen_k must be below 2**31 - 1024"
    return None


def hopper_reason(prob, compute_capability) -> Optional[str]:
    """Why the Hopper varlen forward cannot run a GPU `VarlenProblem`, or None: `dense_reason`'s
    checks, compute capability 9.0, head dims from 64, rows that do not overlap and heads that do
    not run backwards (the tensor maps' strides are unsigned), packed row counts
    below 2^31 (the tensor maps' int32 row coordinates), the driver's tensor-map API."""
    why = dense_reason(prob, compute_capability)
    if why is not None:
        return why
    if compute_capability != 90:
        return ("it is built for sm_90a and runs on compute capability 9.0 only "
                f"(this GPU: {compute_capability})")
    if prob.d < 64:
        return f"it takes head dims from 64 to 256 (got {prob.d})"
    for name, x in (("q", prob.q), ("k", prob.k), ("v", prob.v)):
        if x.shape[0] > 1 and x.strides[0] <= 0:
            return f"the rows of {name} must not overlap (row stride {x.strides[0]})"
        if x.shape[1] > 1 and x.strides[1] < 0:  # tensor-map strides are unsigned
            return f"the heads of {name} must not run backwards (head stride {x.strides[1]})"
        if x.shape[0] >= 2**31 - 2**20:
            return f"{name} has {x.shape[0]} rows; the tensor maps take fewer than 2**31 - 2**20"
    from . import _tma

    if not _tma.available():
        return f"the CUDA driver's tensor-map API is unavailable ({_tma.unavailable_reason()})"
    return None


def varlen_plan_for(prob, compute_capability):
    """The plan of a GPU `VarlenProblem`: ``kernel="decode"`` the decode family's
    (`_decode.decode_plan`), ``kernel="tensorcore"`` the dense mma.sync forward's varlen twin
    (`_dispatch.varlen_tensorcore_plan`), ``kernel="hopper"`` the Hopper forward's
    (`_dispatch.varlen_hopper_plan`), each a ValueError when its reason (`dense_reason`,
    `hopper_reason`) says no; ``kernel="auto"`` a dense twin for prefill-like calls when
    `VARLEN_DENSE_AUTO` is on (the Hopper one first with `VARLEN_HOPPER_AUTO`) and it can run
    them, else the decode family's."""
    from . import _decode, _dispatch

    auto_dense = prob.kernel == "auto" and VARLEN_DENSE_AUTO and not decode_like(prob)
    if prob.kernel == "hopper" or (auto_dense and VARLEN_HOPPER_AUTO):
        why = hopper_reason(prob, compute_capability)
        if why is None:
            return _dispatch.varlen_hopper_plan(prob.dtype_name, prob.d, prob.causal, prob.max_q,
                                                prob.max_k)
        if prob.kernel == "hopper":
            raise ValueError(f"attention_varlen(kernel='hopper') cannot run these inputs: {why}")
    if prob.kernel == "tensorcore" or auto_dense:
        why = dense_reason(prob, compute_capability)
        if why is None:
            plan = _dispatch.varlen_tensorcore_plan(prob.dtype_name, prob.d, prob.causal,
                                                    compute_capability)
            why = _dispatch.smem_reason(plan, compute_capability,
                                        VARLEN_STATIC_SMEM[plan.spec.family])
            if why is None:
                return plan
        if prob.kernel == "tensorcore":
            raise ValueError(f"attention_varlen(kernel='tensorcore') cannot run these inputs: "
                             f"{why}")
    return _decode.decode_plan(prob.dtype_name, prob.d, prob.causal, paged=False,
                               rows=prob.h // prob.hkv * prob.max_q)


def dense_params(plan, prob, o, lse):
    """(AttnParams record, VarlenParams record, grid blocks) of the dense varlen forward for a GPU
    `VarlenProblem` writing o (total_q, H, Dv) and lse (H, total_q) or None (any objects with
    ``data.ptr``, ``strides``, ``itemsize``; nothing is launched or allocated).

    Batch (nb0, nb1, nb2) = (B sequences, Hkv, G), G = H / Hkv, batch stride 0 on the sequence
    axis (the rows come from cu_seqlens through the segment view, common.cuh:
    fwd_varlen_segment), query head h = (kv head, group member) as in `attention`'s grouped
    heads (k, v stride 0 on the group axis); sq, sk = max_seqlen_q/k; n_mblocks =
    ceil(max_seqlen_q / BM); one block per (sequence, head, query block of max_seqlen_q rows)."""
    from . import _launch

    g = prob.h // prob.hkv
    qe, ke, ve, oe = ([s // x.itemsize for s in x.strides] for x in (prob.q, prob.k, prob.v, o))
    p = np.zeros((), dtype=_launch.PARAMS_DTYPE)
    p["q"], p["k"], p["v"], p["o"] = (x.data.ptr for x in (prob.q, prob.k, prob.v, o))
    p["lse"] = 0 if lse is None else lse.data.ptr
    p["sq"], p["sk"], p["d"], p["dv"] = prob.max_q, prob.max_k, prob.d, prob.dv
    p["nb0"], p["nb1"], p["nb2"] = prob.nseq, prob.hkv, g
    for name, st in (("q", qe), ("o", oe)):
        p[f"{name}_s0"], p[f"{name}_s1"], p[f"{name}_s2"], p[f"{name}_sr"] = (
            0, g * st[1], st[1], st[0])
    for name, st in (("k", ke), ("v", ve)):
        p[f"{name}_s0"], p[f"{name}_s1"], p[f"{name}_s2"], p[f"{name}_sr"] = 0, st[1], 0, st[0]
    n_mblocks = -(-prob.max_q // plan.block_m)
    p["n_mblocks"] = n_mblocks
    p["scale_log2"] = prob.scale * _launch._LOG2E
    p["scale"] = prob.scale
    vl = np.zeros((), dtype=_launch.VARLEN_PARAMS_DTYPE)
    vl["cu_q"], vl["cu_k"] = prob.cu_q.data.ptr, prob.cu_k.data.ptr
    vl["lse_hs"] = 0 if lse is None else lse.strides[0] // 4
    if plan.spec.family == "attn_wgmma":
        # A block per work slot of a compact per-head numbering (common.cuh: varlen_slot):
        # floor(total_q / U) + B slots of U rows, U = BM or, for pairs of query blocks under
        # the causal mask (attn_wgmma.cu: cuflash_fwd_wgmma_varlen), 2 BM.
        # A block walks `group` consecutive slots of its sequence (VARLEN_HOPPER_GROUP): the
        # numbering counts groups of group U rows.
        group = int(VARLEN_HOPPER_GROUP)
        if group < 1:
            raise ValueError(f"_varlen.VARLEN_HOPPER_GROUP must be >= 1, got {group}")
        rows = plan.block_m * (2 if plan.pairs else 1) * group
        vl["slots"] = per = prob.q.shape[0] // rows + prob.nseq
        vl["group"] = group
        # The view numbers batch entry b = s H + h's slots from b per_s on in unsigned int
        # (cuflash_fwd_wgmma_varlen: view.slot, view.end), up to B H per_s for the last
        # sequence's last head, per_s <= its query blocks (pairs) at max_seqlen_q. Past 2^32
        # they wrap and the walk would run other slots or none: refuse (the mma.sync twin's
        # grid, ceil(max_seqlen_q / BM) B H blocks, is past its own limit there too).
        per_max = -(-prob.max_q // plan.block_m)
        per_max = (per_max + 1) // 2 if plan.pairs else per_max
        if prob.nseq * prob.h * per_max >= 2**32:
            raise ValueError(f"attention_varlen: {prob.nseq} sequences x {prob.h} heads x "
                             f"{per_max} work slots (max_seqlen_q {prob.max_q}) pass the Hopper "
                             "varlen kernel's 32-bit slot numbering (2**32)")
        p = _hopper_record(plan, prob, p)
    else:  # mma.sync: a block per query block of max_seqlen_q rows, (B, Hkv, G) entries
        per = n_mblocks * prob.nseq
        vl["group"] = 1
    grid = per * prob.h
    if grid > _launch.MAX_GRID_X or per >= 2**32:
        raise ValueError(f"attention_varlen: too many blocks for one launch: {per} query blocks "
                         f"x {prob.h} heads > {_launch.MAX_GRID_X}")
    return p[()], vl[()], grid


def _hopper_record(plan, prob, p):
    """The Hopper twin's `HopperParams`: `p`'s AttnParams fields and tensor maps over the packed
    tensors (`_launch._fill_tensor_maps`: rows = total_q / total_k, batch axes (sequence: size 1,
    Hkv, G), the group axis size 1 for k and v)."""
    from types import SimpleNamespace

    from . import _launch

    hp = np.zeros((), dtype=_launch.HOPPER_PARAMS_DTYPE)
    for name in _launch.PARAMS_DTYPE.names:
        hp[name] = p[name]
    g = prob.h // prob.hkv
    tensors = (prob.q, prob.k, prob.v)
    el = [[s // x.itemsize for s in x.strides] for x in tensors]
    bstr = [[0, g * el[0][1], el[0][1]], [0, el[1][1], 0], [0, el[2][1], 0]]
    # A size-1 batch axis (the group axis when H == Hkv, the kv-head axis of MQA) has coordinate
    # 0: give it stride 0 (a size-1 dim of the map) so that its unchecked stride never reaches
    # the driver, which takes only multiples of 16 bytes from 0 to 2^40.
    bstr = [[st if n > 1 else 0 for st, n in zip(b, (prob.nseq, prob.hkv, g))] for b in bstr]
    rstr = [e[0] for e in el]
    geo = SimpleNamespace(sq=prob.q.shape[0], sk=prob.k.shape[0], d=prob.d,
                          dtype_name=prob.dtype_name)
    _launch._fill_tensor_maps(hp, plan, geo, tensors, [prob.nseq, prob.hkv, g], bstr, rstr)
    return hp


#: Static shared memory of the varlen twins beside the plan's dynamic bytes (ptxas, NVRTC 13.0):
#: the mma.sync twin's segment view and flag, 256 bytes; the Hopper twin's WgmmaVarlenView, 1024
#: (placed before the 1024-byte aligned dynamic block).
VARLEN_STATIC_SMEM = {"attn_mma": 256, "attn_wgmma": 1024}


def dense_gpu(prob, plan, attrs, o, lse, stream):
    """Launch a dense varlen twin (`dense_params`) on `stream`; no allocation, no sync."""
    from . import _compile

    need = plan.smem_bytes + VARLEN_STATIC_SMEM[plan.spec.family]
    if need > attrs["max_smem_optin"]:
        raise ValueError(f"{plan.label} needs {need} bytes of shared memory per block; this GPU "
                         f"allows {attrs['max_smem_optin']}")
    params, vl, grid = dense_params(plan, prob, o, lse)
    if grid == 0:
        return
    kern = _compile.get_kernel(plan.spec, prob.device_id, plan.smem_bytes)
    kern((grid,), (plan.threads,), (params, vl), shared_mem=plan.smem_bytes, stream=stream)


def varlen_launch(prob, attrs):
    """(plan, `_decode.DecodeLaunch` or None, workspace bytes) of a GPU `VarlenProblem`. The
    decode family's grid covers max_seqlen_q query rows and max_seqlen_k keys per sequence and
    its workspace holds the split partials (`DecodeLaunch.part_bytes`); the dense varlen forward
    (`varlen_plan_for`) needs no workspace (0 bytes, None)."""
    from . import _decode

    plan = varlen_plan_for(prob, attrs["compute_capability"])
    if plan.spec.family != "attn_decode":
        return plan, None, 0
    cfg = _decode.configure(plan, (1, prob.nseq, prob.hkv), prob.h // prob.hkv, prob.max_q,
                            prob.max_k, prob.d, attrs)
    return plan, cfg, cfg.part_bytes


def varlen_gpu(prob):
    """The GPU path (`varlen_plan_for`: the decode kernel family with per-sequence offsets, or
    the dense mma.sync forward's varlen twin), on the launch stream; scratch in
    ``prob.workspace`` or a pool allocation on that stream. Never synchronises."""
    import cupy

    from . import _decode, _launch

    with cupy.cuda.Device(prob.device_id):
        attrs = _decode.attrs_or_raise(prob, "attention_varlen", [prob.q, prob.k, prob.v, prob.out])
        st = _launch._stream_ptr(prob.stream)
        plan, cfg, need = varlen_launch(prob, attrs)
        ws = _decode.scratch(need, prob.workspace, st, "attention_varlen_workspace_size")
        total_q = prob.q.shape[0]
        with st:
            o = prob.out if prob.out is not None else cupy.empty((total_q, prob.h, prob.dv),
                                                                  dtype=prob.q.dtype)
            lse = prob.out_lse
            if prob.return_lse and lse is None:
                lse = cupy.empty((prob.h, total_q), dtype=cupy.float32)
        if cfg is None:
            dense_gpu(prob, plan, attrs, o, lse, st)
            return o, lse
        g = prob.h // prob.hkv
        qe, oe, ke, ve = ([s // x.itemsize for s in x.strides] for x in (prob.q, o, prob.k, prob.v))
        le = [s // 4 for s in lse.strides] if lse is not None else [0, 0]
        geom = _decode.DecodeGeometry(
            sizes=(1, prob.nseq, prob.hkv), g=g, sq=prob.max_q, sk=prob.max_k, d=prob.d,
            q=(0, 0, g * qe[1], qe[1], qe[0]), o=(0, 0, g * oe[1], oe[1], oe[0]),
            l=(0, 0, g * le[0], le[0], le[1]), k=(0, 0, ke[1], ke[0]), v=(0, 0, ve[1], ve[0]),
            cu_q=prob.cu_q, cu_k=prob.cu_k)
        _decode.launch(plan, geom, prob.q, prob.k, prob.v, o, lse, scale=prob.scale,
                       device_id=prob.device_id, stream=st, cfg=cfg, parts=ws)
    return o, lse


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                     causal=False, scale=None, return_lse=False, out=None, workspace=None,
                     stream=None, kernel="auto"):
    """Attention over a packed batch of variable-length sequences, with no padding work.

    Parameters
    ----------
    q : array, shape (total_q, H, D)
    k : array, shape (total_k, Hkv, D)
    v : array, shape (total_k, Hkv, Dv)
        The sequences' rows one after another (FlashAttention's varlen layout). float16,
        bfloat16, float32, float64 (on the GPU: float16 and bfloat16, D == Dv, D % 8 == 0).
        ``H % Hkv == 0``: query head ``h`` uses kv head ``h // (H // Hkv)``.
    cu_seqlens_q, cu_seqlens_k : int32 array, shape (B + 1,)
        Sequence ``s`` is rows ``cu_seqlens_q[s]:cu_seqlens_q[s + 1]`` of q and
        ``cu_seqlens_k[s]:cu_seqlens_k[s + 1]`` of k and v (starting at 0, non-decreasing). On
        the GPU C-contiguous and on q's device (the kernels read them as dense arrays).
    max_seqlen_q, max_seqlen_k : int
        The longest sequence's rows in q and in k (they size the GPU grid). Python ints, a
        required argument so that the call never reads cu_seqlens back from the device (which
        would synchronise it); they may be upper bounds (a captured graph can keep them while
        the lengths below them change). Smaller than a GPU sequence's length is not detected:
        the decode family then leaves its rows past max_seqlen_q unwritten and its keys past
        max_seqlen_k unread, the mma.sync twin its rows past max_seqlen_q unwritten (the Hopper
        twin's grid comes from total_q and the offsets, so it is not affected).
    causal : bool, optional
        Bottom-right aligned per sequence: query ``i`` of a sequence sees its keys
        ``j <= i + Sk_s - Sq_s``.
    scale, return_lse, out, stream
        As in `attention`; ``out`` is o (total_q, H, Dv) or with ``return_lse`` (o, lse),
        neither a broadcast view nor sharing memory with the other.
    workspace : GPU array, optional
        GPU only. A C-contiguous buffer on the inputs' device of at least
        ``attention_varlen_workspace_size(...)`` bytes (same arguments), starting on a 256-byte
        boundary; its contents on entry do not matter. When the kernel splits the keys over
        s > 1 blocks it holds the float32 partial outputs, ``E * s * R * Dpad * 4`` bytes, then
        (256-byte aligned) the partial lse, ``E * s * R * 4`` bytes, with ``E = B * Hkv``,
        ``R`` = ``G * max_seqlen_q`` (``G = H / Hkv``) rounded up to a multiple of 16, or of
        32 when it is > 16 and ``Dpad <= 128``, and ``Dpad`` the head dim rounded up to 64,
        128 or 256; with one split it is not touched (size 0). Without it
        that memory comes from CuPy's memory pool (on the launch stream). With ``out=`` and
        ``workspace=`` the call allocates nothing and can be captured in a CUDA graph.
    kernel : {"auto", "decode", "tensorcore", "hopper"}, optional
        GPU only. "decode": the decode kernel family with per-sequence offsets (split keys, the
        query heads of a group packed into one tile; made for few query rows). "tensorcore":
        the dense mma.sync forward kernel on each sequence (prefill; no workspace; head dims up
        to 256). "hopper": the dense Hopper (TMA, wgmma) forward on each sequence (compute
        capability 9.0, head dims 64 to 256, no workspace). "auto": a dense one for
        prefill-like calls when ``cuflash._varlen.VARLEN_DENSE_AUTO`` is on ("hopper" first
        with ``VARLEN_HOPPER_AUTO``; both on since the GPU suite passed with them), else "decode"
        (always for decode-like calls: ``max_seqlen_q <= 16`` and
        ``H / Hkv * max_seqlen_q <= 128``). `varlen_dispatch_info` names the kernel.

    Returns
    -------
    o : array, shape (total_q, H, Dv)
    lse : array, shape (H, total_q), float32 (FlashAttention's softmax_lse layout), only with
        ``return_lse``. Rows of a sequence with no key give o = 0 and lse = -inf; query rows past
        ``cu_seqlens_q[-1]`` belong to no sequence and are left unwritten on the GPU (0 and
        -inf on the CPU). To merge two results with `merge_states`, pass
        ``o.transpose(1, 0, 2)`` (H, total_q, Dv) with lse as it is (o as returned does not match
        lse's axes; when ``total_q == H`` the shapes agree but the rows take the wrong weights).

    Raises
    ------
    TypeError, ValueError
        As `attention`, plus cu_seqlens that are not int32 (B + 1,) arrays (on the GPU also not
        C-contiguous). For NumPy inputs
        also offsets that do not start at 0, decrease, or pass the tensors' rows, and sequences
        longer than max_seqlen. A ``workspace`` as `attention_with_kvcache` refuses it. GPU
        inputs: the offsets live on the device and are not read back
        (no synchronisation); wrong offsets or a too small max_seqlen are the caller's error.
    """
    prob = check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                        causal=causal, scale=scale, return_lse=return_lse, out=out,
                        stream=stream, kernel=kernel, workspace=workspace)
    o, lse = varlen_numpy(prob) if prob.backend == "cpu" else varlen_gpu(prob)
    return (o, lse) if prob.return_lse else o


def attention_varlen_workspace_size(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                    max_seqlen_k, *, causal=False, kernel="auto"):
    """Bytes of GPU workspace `attention_varlen` needs for these arguments (0 for NumPy inputs;
    the layout is under ``workspace`` there). Validates like `attention_varlen`; launches,
    allocates and synchronises nothing (it depends on shapes, max_seqlen_q/k and the device's
    SM count, not on the cu_seqlens contents)."""
    prob = check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                        causal=causal, scale=None, return_lse=False, out=None, stream=None,
                        kernel=kernel)
    if prob.backend == "cpu":
        return 0
    from . import _decode

    attrs = _decode.attrs_or_raise(prob, "attention_varlen", [prob.q, prob.k, prob.v])
    return varlen_launch(prob, attrs)[2]


def varlen_dispatch_info(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                         causal=False, kernel="auto"):
    """The kernel `attention_varlen` would run for these arguments (``"cpu-numpy"`` for NumPy
    inputs), e.g. ``"decode<float16,D128,BN16,W4,dense,causal>"`` or
    ``"varlen-tensorcore<float16,D128,BM128,BN48,causal>"`` or
    ``"varlen-hopper<float16,D128,BM128,BN128,S2,Q1,overlap,pingpong,causal>"``. Validates like it (the
    GPU's checks too); launches nothing."""
    prob = check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                        causal=causal, scale=None, return_lse=False, out=None, stream=None,
                        kernel=kernel)
    if prob.backend == "cpu":
        return "cpu-numpy"
    from . import _decode

    attrs = _decode.attrs_or_raise(prob, "attention_varlen", [prob.q, prob.k, prob.v])
    return varlen_plan_for(prob, attrs["compute_capability"]).label
