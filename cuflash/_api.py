"""The public functions: `attention`, `attention_backward`, `merge_states`, `dispatch_info`,
`gpu_available`, the workspace queries of both and the backward's dispatch query."""
from __future__ import annotations

from . import _callcache, _checks, _interop


def attention(q, k, v, *, causal=False, scale=None, return_lse=False, out=None, stream=None,
              kernel="auto", precision=None, window=None, softcap=None, alibi_slopes=None,
              bias=None, mask=None, score_mod=None, mask_mod=None, mod_args=None,
              workspace=None):
    """Exact scaled-dot-product attention, ``softmax(scale * q @ k^T [+ mask]) @ v``.

    Computed with the tiled online-softmax recurrence: no ``Sq x Sk`` matrix is formed and the
    extra memory is O(S). The running max, running sum and unnormalised output accumulate in
    float32 (float64 for float64 inputs).

    Parameters
    ----------
    q : array, shape (..., Sq, D)
    k : array, shape (..., Sk, D)
    v : array, shape (..., Sk, Dv)
        float16, bfloat16, float32 or float64, all the same dtype and on the same device.
        Leading (batch) axes broadcast NumPy-style, so a key/value head axis of size 1 gives
        multi-query attention; 2-D inputs are a single head. Any ``Sq, Sk >= 1``;
        ``1 <= D, Dv <= 256``.

        *Grouped-query heads.* Beside broadcasting, the head axis (axis -3, the one before the
        sequence axis) may hold ``H`` query heads in q and ``Hkv`` key/value heads in k and v
        with ``1 < Hkv < H`` and ``H % Hkv == 0``: query head ``h`` then attends to key/value
        head ``h // (H // Hkv)`` (FlashAttention's and PyTorch's ``enable_gqa`` rule). It is
        computed as a broadcast over the head axis split into ``(Hkv, H // Hkv)`` (a view: no
        copy, K and V are not repeated), and o and lse have q's ``H`` heads.

        *Where they run.* NumPy arrays (and CPU DLPack objects) run the same tiled recurrence on
        the CPU in NumPy. CuPy arrays, and GPU arrays exposing ``__cuda_array_interface__``
        (Numba, PyTorch) or ``__dlpack__`` (PyTorch, JAX), run on their GPU, viewed without a
        copy. bfloat16 on the CPU needs ``ml_dtypes``.

        *Strides.* An input whose last axis is contiguous is used as it is, whatever its other
        strides, so a ``(B, S, H, D)`` buffer passed as a ``(B, H, S, D)`` transposed view costs
        nothing. A GPU input whose last axis is not contiguous is copied once (a temporary
        allocation). More than three batch axes that no stride pattern lets us merge are also
        copied once.
    causal : bool, optional
        Apply a causal mask aligned to the bottom-right corner of the score matrix (as
        FlashAttention >= 2.1 and cuDNN do): query ``i`` sees keys ``j <= i + (Sk - Sq)``.
        With ``Sq > Sk`` the first ``Sq - Sk`` query rows see no key; their output is 0 and their
        lse is ``-inf`` (never NaN).
    scale : float, optional
        Multiplies ``q @ k^T`` before the softmax. Default ``1 / sqrt(D)``.
    return_lse : bool, optional
        Also return ``lse``, float32 of shape ``(..., Sq)``: the natural log of each row's softmax
        denominator, ``logsumexp(scale * q @ k^T)`` over the visible keys. With it, partial
        results over disjoint key sets combine exactly through `merge_states`.
    out : array or (array, array), optional
        Buffer for ``o`` (shape ``(..., Sq, Dv)``, the input dtype, same device, contiguous last
        axis), or with ``return_lse=True`` a pair ``(o, lse)``, a tuple or a list of two (lse
        C-contiguous float32). Each element of a buffer is written once: a broadcast view
        (stride 0 on an axis of size > 1) or an o and lse that share memory raise ValueError.
        When given, the outputs are not allocated (the decode kernel's split partials still
        are unless ``workspace`` is given).
    stream : cupy.cuda.Stream, torch.cuda.Stream or int, optional
        GPU only: the stream to launch on. Default: CuPy's current stream. The call never
        synchronises the device.
    kernel : {"auto", "generic", "tensorcore", "hopper", "decode"}, optional
        GPU only. ``"auto"`` lets the dispatcher pick the fastest correct kernel (the decode
        kernel for at most 16 query rows, one if causal, and at most 128 query rows per kv head,
        counting the query heads of a group); ``"decode"`` demands the decode kernel (float16/bfloat16,
        compute capability 8.0+, D == Dv, D % 8 == 0, 16-byte aligned rows: it packs the query
        heads of a grouped-query group into one tile and splits the keys across blocks, see
        notes/INFERENCE.md); ``"generic"``
        forces the scalar audit kernel (float32/float64 arithmetic, accurate exp);
        ``"tensorcore"`` demands the mma.sync tensor-core kernel (compute capability 8.0+:
        float16/bfloat16 with D % 8 == 0, float32 with D % 4 == 0 and D <= 256; for precision
        "highest" above D = 128 ``"auto"`` takes it while ``_dispatch.F32_D256_AUTO`` is set,
        as it is by default) and ``"hopper"`` the
        TMA/wgmma kernel (compute capability 9.0, float16/bfloat16 with 64 <= D <= 256, float32
        with 64 <= D <= 128 and D % 8 == 0 in either precision mode, which ``"auto"`` takes
        there too: ``_dispatch.HOPPER_F32_AUTO``); both need
        D == Dv and 16-byte aligned rows, and raise ValueError, saying why, if the inputs do not
        qualify. With a variant (window, softcap, alibi_slopes, bias, mask, hooks) ``"auto"``
        takes the tensor-core kernel where it qualifies (bias and mask contiguous or broadcast
        along their last axis), else the generic one; ``"hopper"`` and ``"decode"`` refuse a
        variant (ValueError naming it).
    precision : {None, "default", "highest", "high"}, optional
        How accurate the products of float32 inputs must be (the names of JAX's
        ``jax.lax.Precision`` and PyTorch's float32 matmul precision; JAX's enum members are
        accepted). ``None``, ``"default"`` and ``"highest"``: float32-accurate. On the tensor
        cores this is the split-precision form: each operand is split into two TF32 parts and
        three products are summed (``x = hi + lo``, ``a_lo b_hi + a_hi b_lo + a_hi b_hi``),
        about 3 * 2^-22 relative error per product against float32's 2^-24, with the P.V
        product of each key tile accumulated apart and added in IEEE float32; expect an error
        near that of a plain float32 matmul -> softmax -> matmul (the audit's pass rule holds it
        to 2x that). ``"high"``: one TF32 product (operands rounded to 10 mantissa bits, about
        2^-11 relative), about three times faster, with errors of order 1e-3 relative to the
        output's size. Paths without a TF32 form (the generic kernel, the CPU path) compute in
        full float32 whatever is asked: precision is the least accuracy the call may deliver.
        float16/bfloat16 products are exact in float32 on every path, so precision changes
        nothing for them; float64 is always computed in float64. `dispatch_info` names the
        mode that runs.
    window : (int, int), optional
        Sliding window ``(left, right)``, bottom-right aligned as ``causal``: query ``i`` sees
        keys ``j`` with ``i + Sk - Sq - left <= j <= i + Sk - Sq + right``; -1 leaves a side
        unbounded (FlashAttention's ``window_size``). With ``causal=True`` the two intersect:
        the window with ``right = 0``.
    softcap : float, optional
        ``c > 0``: each scaled score ``t = scale * q . k`` becomes ``c * tanh(t / c)`` (before
        alibi, bias and the masks). None or 0: off.
    alibi_slopes : array, shape (H,) or (B, H), float32, optional
        Adds ``-slope * |i + Sk - Sq - j|`` after the cap. Aligned with the trailing batch axes:
        ``(H,)`` with ``batch[-1]``, ``(B, H)`` with ``batch[-2:]`` (size 1 broadcasts), on the
        inputs' device.
    bias : array, optional
        An additive score term broadcastable to ``(..., Sq, Sk)`` (``...`` the batch; it may
        not enlarge it), float16, bfloat16, float32 or float64, on the inputs' device; read one
        tile at a time, never materialised. ``-inf`` entries mask (under a score_mod only where
        the hook keeps them ``-inf``: the bias is its input).
    mask : array of bool or cuflash.BlockMask, optional
        Broadcastable to ``(..., Sq, Sk)``; True = keep. Rows that the variant leaves with no
        key give 0 and ``lse = -inf`` (never NaN). All variant semantics: `cuflash.variants`.
        The tensor-core kernels compute a tile whose 64 x 64 mask blocks keep every entry
        without reading the mask (the same result): for a plain GPU array the block summary is
        made on every call (one pass over the mask on the call's stream and
        ``prod(batch of mask) * ceil(R / 64) * ceil(C / 64)`` bytes from CuPy's pool, R x C the
        mask's last two axes); `cuflash.block_mask` makes it once, for reuse and CUDA graphs.
    score_mod : cuflash.ScoreMod, optional
        A user score modification (CUDA C for the GPU, a NumPy callable for the CPU path and the
        references; :mod:`cuflash.mods`), applied to the score after softcap, alibi and bias.
        GPU: the generic, tensor-core and Hopper forward kernels. Its CUDA code sees
        ``q_idx``, ``kv_idx`` as the row's and key's own indices (not bottom-right aligned).
    mask_mod : cuflash.MaskMod, optional
        A user mask ``keep(b, h, q_idx, kv_idx, args)``, one more visibility condition.
        Every tile under the causal limit (and a window's reach) is visited, unless
        ``cuflash._dispatch_variants.HOOK_BLOCKS`` is on (off by default; its GPU tests have
        not passed yet): then the GPU forwards first run the hook over every (row, key) on
        the call's stream (``nb * nh * Sq * Sk`` evaluations, ``nb`` / ``nh`` the batch entries
        / heads if its code names ``b`` / ``h``, else 1), visit per 64 rows only the key tiles
        between the first and the last 64 x 64 block it does not hide, and skip the hook on
        tiles inside a run of blocks it keeps entirely; two arrays from CuPy's pool per call
        (``nb * nh * RB * CB`` bytes and ``nb * nh * (4 RB + 2 CB)`` int32, RB = ceil(Sq / 64),
        CB = ceil(Sk / 64)). The same result either way.
    mod_args : array, shape (n,), float32, optional
        The hooks' ``args`` (per-head constants, tables, document ids), on the inputs' device;
        needed, non-empty, when a hook's CUDA code reads ``args`` (else ValueError).
    workspace : GPU array, optional
        GPU only. Scratch memory for the decode kernel (the only kernel of `attention` that
        needs any): a C-contiguous buffer on the inputs' device of at least
        ``attention_workspace_size(...)`` bytes (same arguments), starting on a 256-byte
        boundary (any fresh CuPy array does); its contents on entry do not matter. When the
        decode kernel splits the keys over s > 1 blocks it holds the float32 partial outputs,
        ``E * s * R * Dpad * 4`` bytes, then (256-byte aligned) the partial lse,
        ``E * s * R * 4`` bytes: ``E`` = batch entries per kv head (the batch size times the
        kv heads), ``R`` packed rows: ``G * Sq`` (``G`` query heads per kv head) rounded up to
        a multiple of 16, or of 32 when ``G * Sq > 16`` and ``Dpad <= 128`` (two row tiles a
        block), and ``Dpad`` the head dim rounded up to 64, 128 or 256; s comes from the
        problem and the SM count (notes/INFERENCE.md). With `_dispatch.HOPPER_F32_PRESPLIT`
        (float32 "highest" on the Hopper kernel, K and V split once per call) it holds the split
        K, then (256-byte aligned) the split V: float16 arrays of K's and V's batch and key axes
        by ``2 * Dpad + 64`` columns. Other kernels need none (size 0) and ignore it; without it
        the decode kernel's partials and the split K and V come from CuPy's pool on the call's
        stream.
        Without it the partials come from CuPy's memory pool, allocated per call on the launch
        stream. With ``out=`` and ``workspace=`` a call whose inputs need no copy (contiguous
        last axes, collapsible batch axes) allocates nothing and never synchronises, so it can
        be captured in a CUDA graph. The workspace's type, size, device and alignment are part
        of a call's signature in the per-signature call cache of repeated calls.

    Returns
    -------
    o : array, shape (..., Sq, Dv), the input dtype
        A NumPy array for CPU inputs; a CuPy array for GPU inputs (whatever their type:
        ``torch.from_dlpack(o)`` or ``jax.dlpack.from_dlpack(o)`` views it without a copy).
    lse : array, shape (..., Sq), float32
        Only with ``return_lse=True``.

    Raises
    ------
    TypeError
        Unsupported or mismatched dtypes, a non-array argument, a NumPy subclass (masked array,
        ``np.matrix``), a non-bool ``causal``.
    ValueError
        Mismatched devices, fewer than 2 dimensions, a zero-length axis, mismatched D between q
        and k or Sk between k and v, a head dim over 256, batch axes that do not broadcast, an
        ``out`` of the wrong shape, dtype, device or layout (a broadcast view, or o and lse
        sharing memory), a ``scale`` that is not finite or
        not usable in the compute dtype (``scale * log2(e)`` outside float32's normal range for
        16- and 32-bit inputs, float64's for float64).

    Notes
    -----
    NaN and inf in the inputs reach exactly the rows that see them. A key that a row cannot see
    (masked by ``causal``) does not touch that row, whatever its values; a row that sees no key
    gives 0 and ``lse = -inf`` even if its q holds NaN. In the rows that see them they propagate
    as in the float64 reference (`cuflash.reference.attention_ref`): a NaN score makes its row
    NaN, and so does a score of +inf (inf - inf, as ``scipy.special.softmax`` gives); a NaN in
    ``v`` makes that column NaN in every row that sees the key; an inf in ``v`` makes it inf, or
    NaN where it meets a weight that rounded to 0 or an inf of the other sign. One exception,
    a known defect: float32 on the tensor cores (precision "highest" and "high", the default
    for float32 on the GPU) splits each operand into parts, and an infinite element's low
    part is ``inf - inf = NaN``, so an inf in ``k`` or ``v`` gives NaN in the rows that see
    the key where the reference may give inf or (a score of -inf) a finite value;
    ``kernel="generic"`` follows the reference there.
    """
    # A signature (types, shapes, strides, dtypes, devices, alignment, flags; the workspace's
    # too) seen before has passed every check and has its plan and parameter block: see
    # _callcache. Variant arguments are not part of a signature: such calls always take the
    # full path.
    plain = window is None and softcap is None and alibi_slopes is None and bias is None \
        and mask is None and score_mod is None and mask_mod is None and mod_args is None
    call = _callcache.signature_of(q, k, v, causal, scale, return_lse, out, kernel, precision,
                                   workspace) if plain else None
    if call is not None:
        res = _callcache.run(call, out, workspace, stream)
        if res is not None:
            return res
    prob = _checks.check_attention(q, k, v, causal=causal, scale=scale, return_lse=return_lse,
                                   out=out, stream=stream, kernel=kernel, precision=precision,
                                   variant=_variant_kwargs(window, softcap, alibi_slopes, bias,
                                                           mask, score_mod, mask_mod,
                                                           mod_args), workspace=workspace)
    if prob.backend == "cpu":
        from ._cpu import attention_numpy

        o, lse = attention_numpy(prob.q, prob.k, prob.v, causal=prob.causal, scale=prob.scale,
                                 out=prob.out, need_lse=prob.return_lse, variant=prob.variant)
        if prob.return_lse and prob.out_lse is not None:
            prob.out_lse[...] = lse
            lse = prob.out_lse
        o, lse = _checks.public_forward(prob, o, lse)
        return (o, lse) if prob.return_lse else o
    return _attention_gpu(prob, call)


def _variant_kwargs(window, softcap, alibi_slopes, bias, mask, score_mod=None, mask_mod=None,
                    mod_args=None):
    kw = dict(window=window, softcap=softcap, alibi_slopes=alibi_slopes, bias=bias, mask=mask)
    if score_mod is not None or mask_mod is not None or mod_args is not None:   # user hooks
        kw.update(score_mod=score_mod, mask_mod=mask_mod, mod_args=mod_args)
    return kw


def _attention_gpu(prob, call=None):
    import cupy

    from . import _dispatch, _launch

    with cupy.cuda.Device(prob.device_id):
        attrs = _launch.device_attributes(prob.device_id)
        plan = _dispatch.plan_for(prob, attrs["compute_capability"])
        o = prob.out
        if o is None:
            o = cupy.empty(prob.o_shape, dtype=prob.q.dtype)
        lse = None
        if prob.return_lse:
            lse = prob.out_lse
            if lse is None:
                lse = cupy.empty(prob.lse_shape, dtype=cupy.float32)
        _launch.launch_forward(plan, prob, o, lse, attrs)
        pub_o, pub_lse = _checks.public_forward(prob, o, lse)
        _callcache.record(call, prob, plan, attrs, o, lse, pub_o, pub_lse)
    return (pub_o, pub_lse) if prob.return_lse else pub_o


def merge_states(o_a, lse_a, o_b, lse_b, *, stream=None):
    """Combine two partial attention results over disjoint key sets.

    The reduction operator of the online-softmax recurrence, on normalised outputs::

        lse = logaddexp(lse_a, lse_b)
        o   = o_a * exp(lse_a - lse) + o_b * exp(lse_b - lse)

    Associative and commutative; a partial that saw no key (``o = 0, lse = -inf``) is the
    identity, and two such partials give ``o = 0, lse = -inf`` (never NaN). Use it for split-K
    attention, decoding over a paged or sharded KV cache, or combining results from several GPUs.

    Parameters
    ----------
    o_a, o_b : array, shape (..., Sq, Dv)
        Partial outputs (as returned by `attention`), same dtype and device; no zero-length
        axis (ValueError, as in `attention`).
    lse_a, lse_b : array, shape (..., Sq), float32
        Their log-sum-exps (``attention(..., return_lse=True)``).
    stream : cupy.cuda.Stream, torch.cuda.Stream or int, optional
        GPU only: the stream to launch on (default: CuPy's current stream).

    Returns
    -------
    o : array, shape (..., Sq, Dv), the dtype of ``o_a``
    lse : array, shape (..., Sq), float32
        NumPy arrays for CPU inputs, CuPy arrays for GPU inputs. The weights,
        ``exp(lse_a - m) / (exp(lse_a - m) + exp(lse_b - m))`` with ``m = max(lse_a, lse_b)``,
        depend on ``lse_a - lse_b`` only and are computed in float32 (float64 for float64
        outputs); the float32 lse values themselves carry a rounding of about ``6e-8 |lse|``, so
        merged outputs, float64 ones too, are accurate to about ``6e-8 (1 + |lse|)`` relative
        (1e-7 for lse of order 1), not to float64 precision. GPU inputs that are not
        C-contiguous are copied once.
    """
    backend, device_id, (o_a, lse_a, o_b, lse_b), dt = _checks.check_merge(o_a, lse_a, o_b, lse_b)
    if stream is not None and backend == "cpu":
        raise ValueError("stream= applies to GPU inputs only; the inputs are NumPy arrays")
    if backend == "cpu":
        from ._cpu import merge_states_numpy

        return merge_states_numpy(o_a, lse_a, o_b, lse_b)
    import cupy

    from . import _launch

    with cupy.cuda.Device(device_id):
        o_a, lse_a, o_b, lse_b = (cupy.ascontiguousarray(x) for x in (o_a, lse_a, o_b, lse_b))
        o = cupy.empty_like(o_a)
        lse = cupy.empty_like(lse_a)
        _launch.launch_merge(o_a, lse_a, o_b, lse_b, o, lse, dt, device_id, stream)
    return o, lse


def attention_workspace_size(q, k, v, *, causal=False, return_lse=False, out=None,
                             kernel="auto", precision=None, window=None, softcap=None,
                             alibi_slopes=None, bias=None, mask=None):
    """Bytes of GPU workspace `attention` needs for these arguments (0 for NumPy inputs and for
    every kernel but the decode kernel when it splits the keys and the float32 Hopper form that
    splits K and V once per call, `_dispatch.HOPPER_F32_PRESPLIT`: K's and V's size; the layout
    is under ``workspace`` there). ``return_lse`` and ``out`` matter because they shape the launch's
    batch layout; pass what the call will. Validates like `attention`; launches, allocates and
    synchronises nothing."""
    prob = _checks.check_attention(q, k, v, causal=causal, scale=None, return_lse=return_lse,
                                   out=out, stream=None, kernel=kernel, precision=precision,
                                   variant=_variant_kwargs(window, softcap, alibi_slopes, bias,
                                                           mask))
    if prob.backend == "cpu":
        return 0
    from . import _decode, _dispatch, _launch

    attrs = _launch.device_attributes(prob.device_id)
    plan = _dispatch.plan_for(prob, attrs["compute_capability"])
    if _launch.is_presplit(plan):   # float32 on Hopper with K and V split once per call
        return sum(_launch.presplit_sections(plan, prob))
    if plan.spec.family != "attn_decode":
        return 0
    return _decode.dense_workspace_bytes(plan, prob, attrs)


def dispatch_info(q, k, v, *, causal=False, kernel="auto", precision=None, window=None,
                  softcap=None, alibi_slopes=None, bias=None, mask=None, score_mod=None,
                  mask_mod=None, mod_args=None):
    """The name of the kernel `attention` would run for these arguments, e.g.
    ``"cpu-numpy"``, ``"generic<float16,D64,full>"`` or
    ``"tensorcore<float32,3xfp16,D128,BM64,BN32,full>"`` (float32 on the tensor cores names
    its product mode: ``3xfp16`` for precision "highest", the fp16-split form, or ``3xtf32`` where
    that form is selected (_dispatch.TC_F32_FORM, HOPPER_F32_FORM) and for a variant, ``tf32`` for
    "high"). With a variant
    (window, softcap, alibi_slopes, bias, mask, user hooks) the label names its parts, e.g.
    ``"tensorcore<float16,D64,BM64,BN64,stagedO,causal,window,softcap>"``, and, where the
    tensor-core kernel was passed over, why, e.g. ``"generic<float64,D64,full,window> (the
    tensor-core kernel cannot run them: ...)"``. Validates like `attention`; launches nothing."""
    prob = _checks.check_attention(q, k, v, causal=causal, scale=None, return_lse=False,
                                   out=None, stream=None, kernel=kernel, precision=precision,
                                   variant=_variant_kwargs(window, softcap, alibi_slopes, bias,
                                                           mask, score_mod, mask_mod,
                                                           mod_args))
    if prob.backend == "cpu":
        return "cpu-numpy"
    from . import _dispatch, _launch

    cc = _launch.device_attributes(prob.device_id)["compute_capability"]
    return _dispatch.plan_for(prob, cc).label


def gpu_available():
    """True when CuPy imports and sees at least one CUDA device."""
    cp = _interop.cupy_or_none()
    if cp is None:
        return False
    try:
        return cp.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no driver, or a driver too old for this CuPy
        return False


def attention_backward(do, q, k, v, o, lse, *, causal=False, scale=None, deterministic=False,
                       out=None, workspace=None, stream=None, kernel="auto", window=None,
                       softcap=None, alibi_slopes=None, bias=None, mask=None,
                       return_dbias=False, score_mod=None, mask_mod=None, mod_args=None,
                       precision=None):
    """Gradients of `attention`: ``(dq, dk, dv)`` for an upstream gradient ``do = dL/do``.

    Recomputes the attention probabilities tile by tile from q, k and the forward's ``lse``
    (``P = exp(scale * q @ k^T - lse)``), so no ``Sq x Sk`` matrix is formed::

        delta = rowsum(do * o),  dv = P^T do,  dS = P * (do @ v^T - delta),
        dq = scale * dS @ k,     dk = scale * dS^T @ q

    Products accumulate in float32 (float64 for float64 inputs).

    Parameters
    ----------
    do : array, shape (..., Sq, Dv)
        The upstream gradient, o's shape and dtype.
    q : array, shape (..., Sq, D)
    k : array, shape (..., Sk, D)
    v : array, shape (..., Sk, Dv)
        The forward's inputs: the same dtypes, devices, broadcasting and stride rules as
        `attention` (float16, bfloat16, float32, float64; NumPy runs the NumPy backward, GPU
        arrays run on their GPU; inputs whose last axis is not contiguous are copied once).
    o : array, shape (..., Sq, Dv)
    lse : array, shape (..., Sq), float32
        What ``attention(q, k, v, causal=causal, scale=scale, return_lse=True)`` returned.
        ``...`` is the broadcast batch shape. For float32 and float64 inputs the backward
        recomputes each row's softmax max and sum in the input precision (one more pass over
        the keys) and uses lse only for float16 and bfloat16: the absolute error of a float32
        lse (a few ulps of ``|lse|``) would be a relative error of every probability.
    causal : bool, optional
        As in `attention` (bottom-right aligned). Query rows that see no key contribute zero
        gradient, never NaN.
    scale : float, optional
        As in `attention`; default ``1 / sqrt(D)``.
    deterministic : bool, optional
        Demand bitwise-identical results from run to run, independent of the launch
        configuration (no order-dependent float atomics). The tensor-core backward (float16,
        bfloat16) accumulates dq with float32 atomics by default; with ``deterministic=True``
        its key blocks add into each dq tile in a fixed order (turn counters; a broadcast q then
        takes the generic backward), which cost 1.2-1.45x in time on an H200
        (notes/BACKWARD.md). The generic GPU kernels and the NumPy path are always
        deterministic (a query-parallel dq pass and a key-parallel dk/dv pass, each summing in a
        fixed order), so it costs nothing with them.
    out : (dq, dk, dv), optional
        Buffers with q's, k's and v's shapes and the input dtype on the inputs' device (all
        three: None in their place raises ValueError), each with a contiguous last axis and no
        overlapping elements (not broadcast views), no two sharing memory (ValueError), and not
        aliasing the inputs (not checked). Every element is written.
    workspace : GPU array, optional
        GPU only. A C-contiguous buffer of at least ``attention_backward_workspace_size(...)``
        bytes, 256-byte aligned (any freshly allocated CuPy array is). Without it the call allocates
        that workspace: ``delta`` (batch x Sq, float32; float64 for float64 inputs), for float32 and
        float64 also the recomputed row max and sum (twice that), and for kernels that accumulate dq
        with atomics a float32 dq accumulator (batch x Sq x row, row = the padded head dim + 4
        for the tensor-core backward). With ``out=`` and ``workspace=``
        nothing is allocated and the call can be captured in a CUDA graph, except in two rare
        layouts that take temporaries: k and v broadcasting along different batch axes, and more
        than three batch axes that no stride pattern merges.
    stream : cupy.cuda.Stream, torch.cuda.Stream or int, optional
        GPU only: the stream to launch on (default: CuPy's current stream). Never synchronises.
    kernel : {"auto", "generic", "tensorcore", "hopper"}, optional
        GPU only. ``"auto"`` lets the dispatcher pick: the tensor-core backward (mma.sync,
        compute capability 8.0+, float16/bfloat16, D == Dv, D % 8 == 0, D <= 128, 16-byte
        aligned rows) where it applies, else the generic one (`backward_dispatch_info` says
        why); ``"generic"`` forces the scalar audit kernels (float32/float64 arithmetic,
        accurate exp); ``"tensorcore"`` demands the tensor-core backward and raises ValueError,
        saying why, when the inputs do not qualify; ``"hopper"`` demands the Hopper backward
        (wgmma, compute capability 9.0, the tensor-core backward's conditions with D <= 256;
        "auto" takes it first there: `cuflash._dispatch.HOPPER_BWD_AUTO`) in the same way. With a variant
        the generic backward runs. float32 inputs: ``"tensorcore"`` runs the float32 tensor-core
        backward (the split-precision "3xfp16" products, float32-accurate; compute capability
        8.0+, D == Dv, D % 8 == 0, D <= 64, at least `cuflash._dispatch.TC_BWD_F32_MIN_SQ` query
        rows (else ValueError), 16-byte aligned rows, no variant), with a tensor-core pass that
        recomputes each row's max, sum and delta first; ``"auto"`` takes it where it applies
        while `cuflash._dispatch.TC_BWD_F32_AUTO` is set (the default), else the generic
        backward.
    window, softcap, alibi_slopes, bias, mask : optional
        The forward's variant, as in `attention` (pass the same values; ``mask`` a bool array,
        summarised per call on the tensor-core backwards, or a `cuflash.BlockMask`). Under softcap the
        gradient of the scaled score is ``dS * (1 - tanh(t / c)^2)``.
    score_mod, mask_mod, mod_args : optional
        The forward's hooks (:mod:`cuflash.mods`); a score_mod needs its derivative
        (``ScoreMod(grad_cuda=, grad_numpy=)``), else ValueError. No gradient for mod_args.
    return_dbias : bool, optional
        Also return ``dbias``, the gradient with respect to ``bias`` (needs ``bias``): the
        gradient of the final scores, ``dS = P * (dP - delta)``, summed over the axes along which
        ``bias`` broadcasts (a ``(Sq, Sk)`` bias shared by every head gets the sum over heads),
        in the working precision, then rounded once to bias's dtype.
    precision : {None, "default", "highest", "high"}, optional
        As in `attention` (pass the forward's value): the least accuracy of float32 products.
        Every float32 backward delivers full float32 ("highest") whatever is asked: the
        tensor-core backward's split products are float32-accurate in both modes, and there is
        no one-pass TF32 backward. Validated for every dtype, used by none other.

    Returns
    -------
    dq : array, q's shape and dtype
    dk : array, k's shape and dtype
    dv : array, v's shape and dtype
        Summed over the batch axes along which q, k or v were broadcast (a shared key/value
        head gets the sum over the query heads that use it, also for grouped-query heads: dk
        and dv of kv head ``j`` sum over its group of ``H // Hkv`` query heads). NumPy arrays for CPU inputs, CuPy
        arrays for GPU inputs; ``out``'s buffers when given.
    dbias : array, bias's shape and dtype
        Only with ``return_dbias=True``: then the result is ``(dq, dk, dv, dbias)``.

    Raises
    ------
    TypeError
        Unsupported or mismatched dtypes (lse must be float32), non-bool ``causal`` or
        ``deterministic``.
    ValueError
        Everything `attention` rejects, plus o, do or lse of the wrong shape or device, ``out``
        not a triple of valid buffers, a ``workspace`` too small, misaligned or on another device.
    """
    prob = _checks.check_backward(do, q, k, v, o, lse, causal=causal, scale=scale,
                                  deterministic=deterministic, out=out, workspace=workspace,
                                  stream=stream, kernel=kernel,
                                  variant=_variant_kwargs(window, softcap, alibi_slopes, bias,
                                                          mask, score_mod, mask_mod,
                                                          mod_args),
                                  return_dbias=return_dbias, precision=precision)
    if prob.backend == "cpu":
        from ._cpu_backward import attention_backward_numpy

        grads = attention_backward_numpy(prob.do, prob.q, prob.k, prob.v, prob.o, prob.lse,
                                         causal=prob.causal, scale=prob.scale,
                                         out=prob.out_grads, variant=prob.variant,
                                         return_dbias=prob.return_dbias)
        return _checks.public_grads(prob, *grads)
    return _checks.public_grads(prob, *_attention_backward_gpu(prob))


def _attention_backward_gpu(prob):
    import cupy

    from . import _dispatch, _launch

    with cupy.cuda.Device(prob.device_id):
        attrs = _launch.device_attributes(prob.device_id)
        bplan = _dispatch.backward_plan_for(prob, attrs["compute_capability"])
        if prob.out_grads is not None:
            dq, dk, dv = prob.out_grads
        else:
            dq, dk, dv = (cupy.empty(x.shape, dtype=x.dtype) for x in (prob.q, prob.k, prob.v))
        dbias = _launch.launch_backward(bplan, prob, dq, dk, dv, prob.workspace, attrs)
    return (dq, dk, dv, dbias) if prob.return_dbias else (dq, dk, dv)


def attention_backward_workspace_size(do, q, k, v, o, lse, *, causal=False, deterministic=False,
                                      kernel="auto", precision=None):
    """Bytes of GPU workspace `attention_backward` needs for these arguments (0 for NumPy
    inputs). Validates like `attention_backward`; launches and allocates nothing."""
    prob = _checks.check_backward(do, q, k, v, o, lse, causal=causal, scale=None,
                                  deterministic=deterministic, out=None, workspace=None,
                                  stream=None, kernel=kernel, precision=precision)
    if prob.backend == "cpu":
        return 0
    from . import _dispatch, _launch

    cc = _launch.device_attributes(prob.device_id)["compute_capability"]
    return _launch.backward_workspace_bytes(_dispatch.backward_plan_for(prob, cc), prob)


def backward_dispatch_info(do, q, k, v, o, lse, *, causal=False, deterministic=False,
                           kernel="auto", window=None, softcap=None, alibi_slopes=None,
                           bias=None, mask=None, return_dbias=False, score_mod=None,
                           mask_mod=None, mod_args=None, precision=None):
    """The name of the backward plan `attention_backward` would run, e.g. ``"cpu-numpy"``,
    ``"tensorcore-bwd<float16,D64,BM64,BN64,causal>"`` (``det,`` in it for deterministic=True;
    ``float32,3xfp16,`` for the float32 tensor-core backward) or
    ``"generic-bwd<float32,D64,full>"``; when ``kernel="auto"`` falls back to the generic backward
    the reason follows in brackets. Validates like `attention_backward` (variant arguments
    included); launches nothing."""
    prob = _checks.check_backward(do, q, k, v, o, lse, causal=causal, scale=None,
                                  deterministic=deterministic, out=None, workspace=None,
                                  stream=None, kernel=kernel,
                                  variant=_variant_kwargs(window, softcap, alibi_slopes, bias,
                                                          mask, score_mod, mask_mod,
                                                          mod_args),
                                  return_dbias=return_dbias, precision=precision)
    if prob.backend == "cpu":
        return "cpu-numpy"
    from . import _dispatch, _launch

    cc = _launch.device_attributes(prob.device_id)["compute_capability"]
    label = _dispatch.backward_plan_for(prob, cc).label
    why = _dispatch.backward_fallback_reason(prob, cc)
    return label if why is None else f"{label} (tensor-core backward not used: {why})"
