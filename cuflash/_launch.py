"""Launch: the kernel parameter block, the launch configuration and its checks, the launch itself.

The device-side `AttnParams` (kernels_cu/common.cuh) is mirrored by `PARAMS_DTYPE`, a NumPy
structured dtype of 8-byte fields, passed by value through CuPy. No device memory is allocated
here and nothing synchronises: a launch is capturable in a CUDA graph.
"""
from __future__ import annotations

import collections
import math

import numpy as np

from . import _compile

_PTR_FIELDS = ("q", "k", "v", "o", "lse")
_INT_FIELDS = ("sq", "sk", "d", "dv", "nb0", "nb1", "nb2",
               "q_s0", "q_s1", "q_s2", "q_sr", "k_s0", "k_s1", "k_s2", "k_sr",
               "v_s0", "v_s1", "v_s2", "v_sr", "o_s0", "o_s1", "o_s2", "o_sr", "n_mblocks")
_PARAMS_FIELDS = ([(f, np.uint64) for f in _PTR_FIELDS] + [(f, np.int64) for f in _INT_FIELDS] +
                  [("scale_log2", np.float64), ("scale", np.float64)])
PARAMS_DTYPE = np.dtype(_PARAMS_FIELDS)
#: `VarlenParams` (kernels_cu/common.cuh): the dense forward's varlen twins' second argument.
VARLEN_PARAMS_DTYPE = np.dtype([("cu_q", np.uint64), ("cu_k", np.uint64), ("lse_hs", np.int64),
                                ("slots", np.int64), ("group", np.int64)])
#: The Hopper kernel's `HopperParams` (kernels_cu/attn_wgmma.cu): three 128-byte tensor maps
#: (64-byte aligned, so the struct's size rounds up to a multiple of 64), `AttnParams`, and the
#: batch-coordinate mask.
#: The pre-split K and V of a HOPPER_F32_PRESPLIT launch (HopperParams::kx ..; zero otherwise).
_PRESPLIT_FIELDS = ([("kx", np.uint64), ("vx", np.uint64)]
                    + [(f"{t}x_{s}", np.int64) for t in "kv" for s in ("s0", "s1", "s2", "sr")])
_HOPPER_TAIL = [("coord_mask", np.int64)] + _PRESPLIT_FIELDS
HOPPER_PARAMS_DTYPE = np.dtype({
    "names": ["tm_q", "tm_k", "tm_v"] + [f for f, _ in _PARAMS_FIELDS + _HOPPER_TAIL],
    "formats": [(np.uint8, 128)] * 3 + [t for _, t in _PARAMS_FIELDS + _HOPPER_TAIL],
    "offsets": [0, 128, 256] + [384 + 8 * i for i in range(len(_PARAMS_FIELDS + _HOPPER_TAIL))],
    "itemsize": -(-(384 + 8 * len(_PARAMS_FIELDS + _HOPPER_TAIL)) // 64) * 64,
})

MAX_GRID_X = 2**31 - 1
_LOG2E = 1.4426950408889634


def _element_strides(x, batch_shape):
    """Element strides of `x` over `batch_shape` + its last two axes, 0 on broadcast batch axes."""
    nb = len(batch_shape)
    st = [s // x.itemsize for s in x.strides]
    shape = list(x.shape)
    pad = nb - (x.ndim - 2)
    bst = [0] * pad + [0 if n == 1 else s for n, s in zip(shape[:-2], st[:-2])]
    return bst, st[-2]


def collapse_batch(batch_shape, *tensors):
    """Merge the batch axes of all `tensors` into at most as few axes as their strides allow.

    Returns (sizes, [batch strides per tensor], [row stride per tensor]). Axes of size 1 are
    dropped; adjacent axes i, i+1 merge when every tensor has stride[i] == stride[i+1] * size[i+1].
    """
    per = [_element_strides(t, batch_shape) for t in tensors]
    sizes = []
    strides = [[] for _ in tensors]
    for ax, n in enumerate(batch_shape):
        if n == 1:
            continue
        if sizes and all(strides[i][-1] == per[i][0][ax] * n for i in range(len(tensors))):
            sizes[-1] *= n
            for i in range(len(tensors)):
                strides[i][-1] = per[i][0][ax]
            continue
        sizes.append(n)
        for i in range(len(tensors)):
            strides[i].append(per[i][0][ax])
    return sizes, strides, [p[1] for p in per]


def _stream_ptr(stream):
    import cupy

    if stream is None:
        return cupy.cuda.get_current_stream()
    if isinstance(stream, int):
        return cupy.cuda.ExternalStream(stream)
    ptr = getattr(stream, "ptr", None)
    if ptr is None:
        ptr = getattr(stream, "cuda_stream", None)  # torch.cuda.Stream
        if ptr is None:
            raise TypeError("stream must be a cupy.cuda.Stream, an object with .ptr or "
                            ".cuda_stream, or an integer cudaStream_t handle")
        return cupy.cuda.ExternalStream(int(ptr))
    return stream


def launch_forward(plan, prob, o, lse, device_attrs):
    """Launch `plan` for the validated problem `prob`, writing `o` and (if not None) `lse`.

    `device_attrs` carries the device limits checked here: max_smem_optin, sm_count.
    """
    import cupy

    if plan.spec.family == "attn_decode":  # few query rows, split keys (cuflash/_decode.py)
        from . import _decode

        _decode.launch_dense(plan, prob, o, lse, device_attrs)
        return
    q, k, v = prob.q, prob.k, prob.v
    key = (plan, prob.device_id, prob.sq, prob.sk, prob.d, prob.dv, prob.scale, prob.batch_shape,
           *((x.data.ptr, x.shape, x.strides) for x in (q, k, v, o)),
           0 if lse is None else lse.data.ptr)
    variant = getattr(prob, "variant", None)   # window/softcap/alibi/bias/mask: _launch_variants
    cached = _PARAM_CACHE.get(key) if variant is None else None
    if cached is not None:  # the same call as a recent one: reuse its parameter block
        _PARAM_CACHE.move_to_end(key)
        params, grid = cached
        kern = _compile.get_kernel(plan.spec, prob.device_id, plan.smem_bytes)
        kern((grid,), (plan.threads,), (params,), shared_mem=plan.smem_bytes,
             stream=_stream_ptr(prob.stream))
        return
    if variant is not None:   # the mask's block summary, made now unless the caller's
        from ._launch_variants import with_hook_ranges, with_mask_blocks
        variant = with_mask_blocks(variant, (plan.spec.family,), prob.device_id, prob.stream)
        variant = with_hook_ranges(variant, (plan,), prob)   # a mask_mod's tiles (HOOK_BLOCKS)
    split_kv = None
    if is_presplit(plan):   # K and V split once, into arrays of this call (never cached below)
        from ._decode import scratch
        sizes = presplit_sections(plan, prob)
        buf = scratch(sum(sizes), getattr(prob, "workspace", None), _stream_ptr(prob.stream),
                      "attention_workspace_size")
        split_kv = presplit_kv(plan, prob, k, v, buf, (0, sizes[0]))
    params, grid, (q, k, v), vparams = forward_params(plan, prob, q, k, v, o, lse, device_attrs,
                                                      variant=variant, split_kv=split_kv)
    kern = _compile.get_kernel(plan.spec, prob.device_id, plan.smem_bytes)
    if vparams is not None:  # a variant's kernels take its VariantParams as a second argument
        kern((grid,), (plan.threads,), (params, vparams), shared_mem=plan.smem_bytes,
             stream=_stream_ptr(prob.stream))
        return
    if q is prob.q and k is prob.k and v is prob.v and split_kv is None:   # nothing of this call
        _PARAM_CACHE[key] = (params, grid)
        if len(_PARAM_CACHE) > _PARAM_CACHE_SIZE:
            _PARAM_CACHE.popitem(last=False)
    kern((grid,), (plan.threads,), (params,), shared_mem=plan.smem_bytes,
         stream=_stream_ptr(prob.stream))


def forward_params(plan, prob, q, k, v, o, lse, device_attrs, variant=None, split_kv=None):
    """The forward's parameter block for these buffers, after the launch-configuration checks.
    ``variant``: the problem's variant as launched (`_launch_variants.with_mask_blocks`; default
    `prob.variant`). ``split_kv``: a HOPPER_F32_PRESPLIT plan's split K and V (`presplit_kv`),
    which the tensor maps and HopperParams::kx, vx point at; k and v themselves (the float32
    inputs) stay in the block for the kernel's exact row path.

    Returns ``(params, grid, (q, k, v), vparams)``: the block (a NumPy structured scalar), the
    number of blocks, the inputs it points at (contiguous full-batch copies when more than three
    batch axes do not merge), and the variant's VariantParams (None without a variant).
    Everything but the five pointers (and, for the Hopper kernel, the tensor maps made from
    them) is a function of the plan, the shapes, strides and scale.
    """
    import cupy

    vparams = None
    if getattr(prob, "variant", None) is not None:
        from ._launch_variants import collapse_with_variant
        sizes, bstr, rstr, vparams = collapse_with_variant(prob, q, k, v, o, variant=variant)
    else:   # (the split K and V collapse with the rest: one set of batch sizes for all six)
        sizes, bstr, rstr = collapse_batch(prob.batch_shape, q, k, v, o, *(split_kv or ()))
    if len(sizes) > 3:
        # More than three batch axes that no stride pattern merges: materialise the inputs once
        # as contiguous full-batch arrays (documented in `attention`), then they collapse to one.
        full = prob.batch_shape
        q, k, v, *split = (cupy.ascontiguousarray(cupy.broadcast_to(t, full + t.shape[-2:]))
                           for t in (q, k, v, *(split_kv or ())))
        split_kv = tuple(split) or None
        sizes, bstr, rstr = collapse_batch(prob.batch_shape, q, k, v, o, *split)
        if len(sizes) > 3:  # o itself was given with an unmergeable layout
            raise ValueError("out has a batch layout with more than three non-mergeable axes; "
                             "pass a C-contiguous out")
    while len(sizes) < 3:
        sizes.insert(0, 1)
        for s in bstr:
            s.insert(0, 0)
    nbatch = sizes[0] * sizes[1] * sizes[2]
    n_mblocks = -(-prob.sq // plan.block_m)

    if max(prob.sq, prob.sk) >= 2**31 - 1024:
        raise ValueError(f"Sq and Sk must be below 2**31 - 1024 (got {prob.sq}, {prob.sk})")
    grid = n_mblocks * nbatch
    if grid > MAX_GRID_X:
        raise ValueError(f"too many blocks for one launch: {n_mblocks} query blocks x {nbatch} "
                         f"batch entries > {MAX_GRID_X}")
    if plan.smem_bytes > device_attrs["max_smem_optin"]:
        raise ValueError(
            f"{plan.label} needs {plan.smem_bytes} bytes of shared memory per block; this GPU "
            f"allows {device_attrs['max_smem_optin']}")
    if plan.threads > 1024:
        raise ValueError(f"{plan.label}: {plan.threads} threads per block > 1024")

    hopper = plan.spec.family == "attn_wgmma"
    p = np.zeros((), dtype=HOPPER_PARAMS_DTYPE if hopper else PARAMS_DTYPE)
    p["q"], p["k"], p["v"], p["o"] = q.data.ptr, k.data.ptr, v.data.ptr, o.data.ptr
    p["lse"] = 0 if lse is None else lse.data.ptr
    p["sq"], p["sk"], p["d"], p["dv"] = prob.sq, prob.sk, prob.d, prob.dv
    p["nb0"], p["nb1"], p["nb2"] = sizes
    for name, bs, rs in zip("qkvo", bstr, rstr):
        p[f"{name}_s0"], p[f"{name}_s1"], p[f"{name}_s2"] = bs
        p[f"{name}_sr"] = rs
    p["n_mblocks"] = n_mblocks
    p["scale_log2"] = prob.scale * _LOG2E
    p["scale"] = prob.scale
    if hopper:   # the maps of q and k, v, or of q and the split K, V (tensors 4 and 5)
        mapped = (0, 1, 2)
        if split_kv is not None:
            mapped = (0, 4, 5)
            p["kx"], p["vx"] = (x.data.ptr for x in split_kv)
            for t, i in (("k", 4), ("v", 5)):
                p[f"{t}x_s0"], p[f"{t}x_s1"], p[f"{t}x_s2"] = bstr[i]
                p[f"{t}x_sr"] = rstr[i]
        _fill_tensor_maps(p, plan, prob, [(q, k, v, o, *(split_kv or ()))[i] for i in mapped],
                          sizes, [bstr[i] for i in mapped], [rstr[i] for i in mapped])

    if plan.pairs:  # query blocks nm - 1 - r and r go to one block (attn_wgmma.cu: WorkWalk)
        grid = -(-n_mblocks // 2) * nbatch
    if plan.persistent:  # one block per SM, each looping over work items (attn_wgmma.cu)
        grid = min(grid, device_attrs["sm_count"])
    return p[()], grid, (q, k, v), vparams


#: Parameter blocks of recent launches, keyed on everything they are made from (plan, pointers,
#: shapes, strides, scale): a repeated call skips the batch-axis collapse and the three tensor-map
#: encodes, which are most of its host time. Raw pointers are only compared, never dereferenced,
#: so a freed and reused address with the same layout yields the same (correct) parameters.
_PARAM_CACHE = collections.OrderedDict()
_PARAM_CACHE_SIZE = 64


def is_presplit(plan) -> bool:
    """Whether `plan` is the 3xfp16 Hopper forward that reads K and V split once per call
    (_dispatch.HOPPER_F32_PRESPLIT)."""
    return plan.presplit_dpad > 0


def presplit_sections(plan, prob):
    """Bytes of the split K and of the split V (`presplit_kv`), each rounded up to
    WORKSPACE_ALIGN: the workspace a HOPPER_F32_PRESPLIT plan's call needs."""
    w = 2 * plan.presplit_dpad + 64
    return [-(-math.prod(x.shape[:-1]) * w * 2 // WORKSPACE_ALIGN) * WORKSPACE_ALIGN
            for x in (prob.k, prob.v)]


def presplit_kv(plan, prob, k, v, buf, offsets):
    """``k`` and ``v`` (float32, shapes (..., Sk, D), any strides) split for `plan` by one
    launch of attn_wgmma.cu's cuflash_split16_kv on the call's stream, each into a contiguous
    float16 array of shape x.shape[:-1] + (2 DPAD + 64,) at its byte offset in `offsets` of the
    flat buffer `buf` (the caller's workspace, or a pool block on the call's stream:
    `presplit_sections`). Row r holds, for each 64 columns, the fp16 hi then lo parts of
    x 2^e, e the exponent of r's key tile of BN keys, stored as int32 at columns 2 DPAD of the
    tile's first row. Returns the two split arrays (k's, v's)."""
    import cupy

    dpad, bn = plan.presplit_dpad, plan.block_n
    pair = np.zeros((), dtype=SPLIT16_PAIR_DTYPE)
    outs, blocks = [], []
    # What the launch reads: a contiguous copy of k must stay alive past the loop, or v's copy
    # could take its pool block before the kernel has read it.
    srcs = []
    for name, x, offset in (("k", k, offsets[0]), ("v", v, offsets[1])):
        sk, d = int(x.shape[-2]), int(x.shape[-1])
        out = cupy.ndarray(tuple(x.shape[:-1]) + (2 * dpad + 64,), dtype=cupy.float16,
                           memptr=buf.data + offset)
        sizes, bstr, rstr = collapse_batch(tuple(x.shape[:-2]), x)
        if len(sizes) > 3:
            x = cupy.ascontiguousarray(x)
            sizes, bstr, rstr = collapse_batch(tuple(x.shape[:-2]), x)
        while len(sizes) < 3:
            sizes.insert(0, 1)
            bstr[0].insert(0, 0)
        if sk == 0:
            raise ValueError(f"presplit: {name} has no keys")
        n_tiles = -(-sk // bn)
        blocks.append(sizes[0] * sizes[1] * sizes[2] * n_tiles)
        sr = rstr[0] if sk > 1 else d
        # 16-byte loads of 8 columns and 16-byte stores (the Hopper plan's own requirements
        # imply these; checked here as for every launch)
        if (x.data.ptr % 16 or out.data.ptr % 16 or sr % 4 or d % 8 or d > dpad
                or any(st % 4 for st in bstr[0])):
            raise ValueError(f"presplit: {name} at {x.data.ptr:#x}, row stride {sr}, batch "
                             f"strides {bstr[0]}, D = {d} (DPAD {dpad}): needs 16-byte aligned "
                             "rows and D % 8 == 0")
        a = pair[name]
        a["x"], a["out"] = x.data.ptr, out.data.ptr
        a["s0"], a["s1"], a["s2"] = bstr[0]
        a["sr"], a["n1"], a["n2"] = sr, sizes[1], sizes[2]
        a["sk"], a["d"], a["n_tiles"] = sk, d, n_tiles
        outs.append(out)
        srcs.append(x)
    if sum(blocks) > MAX_GRID_X:
        raise ValueError(f"presplit: {blocks[0]} + {blocks[1]} key tiles of K and V is too many "
                         "for one launch")
    pair["first_v"] = blocks[0]
    from ._dispatch import presplit_spec
    kern = _compile.get_kernel(presplit_spec(dpad, bn), prob.device_id)
    kern((sum(blocks),), (SPLIT16_THREADS,), (pair[()],), stream=_stream_ptr(prob.stream))
    return tuple(outs)


#: attn_wgmma.cu's SPLIT16_THREADS: threads of a cuflash_split16_kv block.
SPLIT16_THREADS = 256


#: attn_wgmma.cu's Split16Params.
SPLIT16_PARAMS_DTYPE = np.dtype([("x", np.uint64), ("out", np.uint64)]
                                + [(f, np.int64) for f in ("s0", "s1", "s2", "sr", "n1", "n2",
                                                           "sk", "d", "n_tiles")])


#: attn_wgmma.cu's Split16Pair: K's and V's Split16Params and the first block of V's.
SPLIT16_PAIR_DTYPE = np.dtype([("k", SPLIT16_PARAMS_DTYPE), ("v", SPLIT16_PARAMS_DTYPE),
                               ("first_v", np.int64)])


def _fill_tensor_maps(p, plan, prob, tensors, sizes, bstr, rstr):
    """The Hopper kernel's tensor maps: one per input, 5-D (D, rows, batch axes 2, 1, 0), boxes of
    128 bytes of columns (64 16-bit or 32 float32 elements) x BM (q) or BN (k, v) rows. A batch axis the tensor broadcasts over (stride 0)
    becomes a size-1 dim with coordinate 0 in the kernel (coord_mask bit clear)."""
    from . import _tma

    bn = plan.block_n
    mask = 0
    pre = is_presplit(plan)   # k and v: presplit_kv's float16 arrays, 2 DPAD columns mapped
    for t, (x, rows, box_rows) in enumerate(zip(tensors, (prob.sq, prob.sk, prob.sk),
                                                (plan.block_m, bn, bn))):
        item = x.itemsize
        cols, dtype_name = ((2 * plan.presplit_dpad, "float16") if pre and t > 0
                            else (prob.d, prob.dtype_name))
        row_bytes = rstr[t] * item if rows > 1 else -(-int(x.shape[-1]) * item // 16) * 16
        dims, strides = [cols, rows], [row_bytes]
        span = row_bytes * rows  # any valid stride for a size-1 dim (its coordinate is always 0)
        for ax in (2, 1, 0):
            if bstr[t][ax] != 0:
                mask |= 1 << (3 * t + ax)
                dims.append(sizes[ax])
                strides.append(bstr[t][ax] * item)
            else:
                dims.append(1)
                strides.append(span)
        p[("tm_q", "tm_k", "tm_v")[t]] = np.frombuffer(
            _tma.encode_tiled(dtype_name, x.data.ptr, dims, strides,
                              [128 // item, box_rows, 1, 1, 1]),
            dtype=np.uint8)
    p["coord_mask"] = mask


def launch_merge(o_a, lse_a, o_b, lse_b, o, lse, dtype_name, device_id, stream=None):
    """Launch the merge kernel on contiguous inputs; o (rows, dv) and lse (rows,) outputs."""
    from ._dispatch import _CXX_TYPE, _ACC_TYPE

    rows = int(math.prod(lse.shape))
    dv = int(o.shape[-1])
    spec = _compile.Specialisation(
        "merge", f"cuflash::cuflash_merge_states<{_CXX_TYPE[dtype_name]}, {_ACC_TYPE[dtype_name]}>")
    kern = _compile.get_kernel(spec, device_id)
    threads = 256
    blocks = -(-rows * dv // threads)
    if blocks > MAX_GRID_X:
        raise ValueError(f"merge_states: {rows * dv} elements is too many for one launch")
    kern((blocks,), (threads,), (o_a, lse_a, o_b, lse_b, o, lse, np.int64(rows), np.int64(dv)),
         stream=_stream_ptr(stream))


_DEVICE_ATTRS = {}


def device_attributes(device_id):
    """Limits of a device that the dispatcher and the launch checks need, read once per device."""
    attrs = _DEVICE_ATTRS.get(device_id)
    if attrs is None:
        import cupy

        dev = cupy.cuda.Device(device_id)
        a = dev.attributes
        attrs = {"compute_capability": int(dev.compute_capability),
                 "max_smem_optin": int(a["MaxSharedMemoryPerBlockOptin"]),
                 "sm_count": int(a["MultiProcessorCount"])}
        _DEVICE_ATTRS[device_id] = attrs
    return attrs


# ---------------------------------------------------------------------------------------------
# Backward pass (notes/BACKWARD.md)

_BWD_PTR_FIELDS = ("q", "k", "v", "o", "dout", "lse", "delta", "lse_acc", "dq_accum", "dq",
                   "dk", "dv")
#: Tensors with batch strides and a row stride, in BwdParams order ("do" is dout, "dqa" dq_accum).
_BWD_STRIDED = ("q", "k", "v", "o", "do", "dq", "dk", "dv", "lse", "dqa")
_BWD_INT_FIELDS = (("sq", "sk", "d", "dv_dim", "nb0", "nb1", "nb2")
                   + tuple(f"{t}_{s}" for t in _BWD_STRIDED for s in ("s0", "s1", "s2", "sr"))
                   + ("q_red", "kv_red", "n_mblocks", "n_nblocks", "deterministic"))
#: The backward kernels' `BwdParams` (kernels_cu/common.cuh), 68 fields of 8 bytes; cu_q and
#: cu_k (packed varlen batches, cuflash/_varlen_backward.py) are 0 for every other call.
BWD_PARAMS_DTYPE = np.dtype([(f, np.uint64) for f in _BWD_PTR_FIELDS]
                            + [(f, np.int64) for f in _BWD_INT_FIELDS]
                            + [("scale_log2", np.float64), ("scale", np.float64)]
                            + [("cu_q", np.uint64), ("cu_k", np.uint64)])
#: Workspace sections start on this alignment (bytes).
WORKSPACE_ALIGN = 256


class _RowsView:
    """lse (..., Sq) seen as (..., Sq, 1), so that collapse_batch treats it like the others."""

    def __init__(self, x):
        self.shape = tuple(x.shape) + (1,)
        self.strides = tuple(x.strides) + (x.itemsize,)
        self.itemsize, self.ndim = x.itemsize, x.ndim + 1


def _acc_bytes(dtype_name):
    return 8 if dtype_name == "float64" else 4


def _align(n):
    return -(-n // WORKSPACE_ALIGN) * WORKSPACE_ALIGN


def backward_workspace_bytes(bplan, prob):
    """Bytes of workspace `launch_backward` needs: delta = rowsum(do * o), (batch, Sq) in the
    accumulator type; (plans that recompute them) each row's softmax max m and sum l in the
    accumulator type, m in delta's layout followed by l; then
    (plans that use one) the float32 dq accumulator, (batch, Sq, row). Sections 256-byte aligned."""
    nbatch = int(math.prod(prob.batch_shape))
    n = _align(nbatch * prob.sq * _acc_bytes(prob.dtype_name))
    if bplan.lse_acc:
        n += _align(2 * nbatch * prob.sq * _acc_bytes(prob.dtype_name))
    if bplan.dq_accum_row:
        n += _align(nbatch * prob.sq * bplan.dq_accum_row * 4)
    return n


def workspace_base(workspace, need, query):
    """The device address of a caller's `workspace` (a flat byte buffer, see
    _checks.check_workspace) for a call that needs `need` bytes; ValueError naming the size
    query `query` (a cuflash function) when it is too small, or when it does not start on a
    WORKSPACE_ALIGN-byte boundary."""
    if workspace.nbytes < need:
        raise ValueError(f"workspace has {workspace.nbytes} bytes; this call needs {need} "
                         f"(cuflash.{query})")
    base = workspace.data.ptr
    if base % WORKSPACE_ALIGN:
        raise ValueError(f"workspace must start on a {WORKSPACE_ALIGN}-byte boundary")
    return base


def _red_mask(bstr):
    """Bit a set where a gradient buffer's collapsed batch stride is 0 (it sums over axis a)."""
    return sum(1 << a for a in range(3) if bstr[a] == 0)


def launch_backward(bplan, prob, dq, dk, dv, workspace, device_attrs):
    """Launch the backward plan `bplan` for the validated `BackwardProblem` `prob`, writing the
    caller's `dq`, `dk`, `dv` (shapes of q, k, v; last axis contiguous; no overlapping rows).

    `workspace`: a CuPy uint8 array of at least `backward_workspace_bytes` bytes, or None to
    allocate one. Two layouts no single launch can express take temporaries (allocated here, and
    summed into the outputs with CuPy afterwards): k and v broadcast along different batch axes,
    and more than three batch axes that no stride pattern merges.
    """
    import cupy

    if max(prob.sq, prob.sk) >= 2**31 - 1024:
        raise ValueError(f"Sq and Sk must be below 2**31 - 1024 (got {prob.sq}, {prob.sk})")
    full = prob.batch_shape
    q, k, v, o, do, lse = prob.q, prob.k, prob.v, prob.o, prob.do, prob.lse
    targets = [dq, dk, dv]
    bufs = list(targets)
    variant = getattr(prob, "variant", None)   # window/softcap/alibi/bias/mask: _launch_variants
    extra = []
    if variant is not None:   # with the mask's block summary (made now unless the caller's)
        from . import _launch_variants as lv
        variant = lv.with_mask_blocks(variant, [pl.spec.family for _, pl in bplan.passes],
                                      prob.device_id, prob.stream)
        # a mask_mod's ranges (HOOK_BLOCKS_BWD: the passes' row ranges and full tiles)
        variant = lv.with_hook_ranges(variant, [pl for _, pl in bplan.passes], prob)
        extra = lv.variant_tensors(variant)

    def collapse():
        return collapse_batch(full, q, k, v, o, do, *bufs, _RowsView(lse), *extra)

    sizes, bstr, rstr = collapse()
    if len(sizes) > 3:
        # Materialise the inputs as contiguous full-batch arrays; gradients go to full-batch
        # temporaries that are summed over the broadcast axes below.
        q, k, v, o, do = (cupy.ascontiguousarray(cupy.broadcast_to(t, full + t.shape[-2:]))
                          for t in (q, k, v, o, do))
        lse = cupy.ascontiguousarray(cupy.broadcast_to(lse, full + lse.shape[-1:]))
        bufs = [cupy.empty(full + t.shape[-2:], dtype=t.dtype) for t in targets]
        sizes, bstr, rstr = collapse()
    while len(sizes) < 3:
        sizes.insert(0, 1)
        for s in bstr:
            s.insert(0, 0)
    # Tensor order in collapse: q k v o do dq dk dv lse.
    if _red_mask(bstr[6]) != _red_mask(bstr[7]):
        # k and v broadcast along different axes: dk and dv per batch entry of the others.
        bufs[1:] = [cupy.empty(full + t.shape[-2:], dtype=t.dtype) for t in targets[1:]]
        sizes, bstr, rstr = collapse()
        while len(sizes) < 3:
            sizes.insert(0, 1)
            for s in bstr:
                s.insert(0, 0)
    if len(sizes) > 3 and variant is not None:   # the variant's tensors do not merge
        raise ValueError(lv.TOO_MANY_AXES)
    q_red, kv_red = _red_mask(bstr[5]), _red_mask(bstr[6])
    nbatch = sizes[0] * sizes[1] * sizes[2]
    vparams = dscores = None
    if variant is not None:
        if getattr(prob, "return_dbias", False):   # ds per (batch entry, row, key): summed below
            acc = np.float64 if prob.dtype_name == "float64" else np.float32
            dscores = cupy.zeros(full + (prob.sq, prob.sk), dtype=acc)
        vparams = lv.fill_params(prob, bstr[9:], dscores, variant=variant)
    owners = {red: math.prod(n for a, n in enumerate(sizes) if not (red >> a) & 1)
              for red in (0, q_red, kv_red)}

    need = backward_workspace_bytes(bplan, prob)
    if workspace is None:
        workspace = cupy.empty(need, dtype=cupy.uint8)
    base = workspace_base(workspace, need, "attention_backward_workspace_size")

    p = np.zeros((), dtype=BWD_PARAMS_DTYPE)
    for name, x in zip(("q", "k", "v", "o", "dout", "lse", "dq", "dk", "dv"),
                       (q, k, v, o, do, lse, *bufs)):
        p[name] = x.data.ptr
    section = _align(nbatch * prob.sq * _acc_bytes(prob.dtype_name))
    p["delta"] = base
    p["lse_acc"] = base + section if bplan.lse_acc else 0
    p["dq_accum"] = 0
    if bplan.dq_accum_row:
        p["dq_accum"] = base + section + (
            _align(2 * nbatch * prob.sq * _acc_bytes(prob.dtype_name)) if bplan.lse_acc else 0)
        # (owners of q, Sq, row) contiguous; stride 0 along the axes dq sums over.
        st, acc = [0, 0, 0], prob.sq * bplan.dq_accum_row
        for a in (2, 1, 0):
            if not (q_red >> a) & 1:
                st[a] = acc
                acc *= sizes[a]
        p["dqa_s0"], p["dqa_s1"], p["dqa_s2"] = st
        p["dqa_sr"] = bplan.dq_accum_row
    p["sq"], p["sk"], p["d"], p["dv_dim"] = prob.sq, prob.sk, prob.d, prob.dv
    p["nb0"], p["nb1"], p["nb2"] = sizes
    for name, bs, rs in zip(("q", "k", "v", "o", "do", "dq", "dk", "dv", "lse"), bstr, rstr):
        p[f"{name}_s0"], p[f"{name}_s1"], p[f"{name}_s2"] = bs
        p[f"{name}_sr"] = rs
    p["q_red"], p["kv_red"] = q_red, kv_red
    n_mblocks = -(-prob.sq // bplan.block_m)
    n_nblocks = -(-prob.sk // bplan.block_n)
    p["n_mblocks"], p["n_nblocks"] = n_mblocks, n_nblocks
    p["deterministic"] = int(bool(prob.deterministic))
    p["scale_log2"] = prob.scale * _LOG2E
    p["scale"] = prob.scale
    params = p[()]

    prep_blocks = -(-prob.sq // bplan.preprocess.block_m)
    launches = [(bplan.preprocess, prep_blocks * nbatch)]
    for grid_kind, plan in bplan.passes:
        if grid_kind == "rows":
            grid = n_mblocks * owners[q_red]
        elif grid_kind == "keys":
            grid = n_nblocks * owners[kv_red]
        elif grid_kind == "dq_convert":
            grid = -(-prob.sq // plan.block_m) * owners[q_red]
        else:
            raise ValueError(f"{bplan.label}: unknown grid mapping {grid_kind!r}")
        launches.append((plan, grid))
    if bplan.dq_accum_row and bplan.dq_accum_row < prob.d:
        raise ValueError(f"{bplan.label}: dq accumulator rows of {bplan.dq_accum_row} < D = {prob.d}")
    for plan, grid in launches:
        if grid > MAX_GRID_X:
            raise ValueError(f"{plan.label}: {grid} blocks is too many for one launch "
                             f"(at most {MAX_GRID_X})")
        if plan.smem_bytes > device_attrs["max_smem_optin"]:
            raise ValueError(
                f"{plan.label} needs {plan.smem_bytes} bytes of shared memory per block; this "
                f"GPU allows {device_attrs['max_smem_optin']}")
        if plan.threads > 1024:
            raise ValueError(f"{plan.label}: {plan.threads} threads per block > 1024")
    if nbatch >= 2**31:
        raise ValueError(f"{nbatch} batch entries is too many (at most 2**31 - 1)")

    stream = _stream_ptr(prob.stream)
    for plan, grid in launches:
        kern = _compile.get_kernel(plan.spec, prob.device_id, plan.smem_bytes)
        args = (params, vparams) if vparams is not None and lv.is_variant_kernel(plan) else (params,)
        kern((grid,), (plan.threads,), args, shared_mem=plan.smem_bytes, stream=stream)

    for tgt, buf in zip(targets, bufs):
        if buf is not tgt:  # a full-batch temporary: sum over the axes the target broadcasts
            _sum_into(tgt, buf, full, stream)
    if dscores is not None:
        from .reference import _sum_to_shape
        with stream:   # the reduction runs on the launch stream
            return _sum_to_shape(dscores, variant.bias.shape).astype(variant.bias.dtype)
    return None


def _sum_into(target, full_grad, batch_shape, stream):
    """target[...] = full_grad summed (in float32, float64 for float64) over the batch axes
    where target has size 1 or is missing."""
    import cupy

    nb = len(batch_shape)
    tshape = (1,) * (nb - (target.ndim - 2)) + tuple(target.shape[:-2])
    axes = tuple(a for a in range(nb) if tshape[a] == 1 and batch_shape[a] != 1)
    acc = cupy.float64 if target.dtype == cupy.float64 else cupy.float32
    with stream:
        s = full_grad.astype(acc).sum(axis=axes, keepdims=True) if axes else full_grad
        target[...] = s.reshape(target.shape).astype(target.dtype)
