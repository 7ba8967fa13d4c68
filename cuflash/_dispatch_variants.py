"""Dispatch of attention variants (window, softcap, ALiBi, bias, mask; cuflash/variants.py).

Kernels take the variant as the policy of kernels_cu/variants.cuh, a template parameter: the
generic kernels (``cuflash_fwd_generic_var<T, Acc, DB, DVB, CAUSAL, Variant<WINDOW, SOFTCAP,
ALIBI, BiasT, MASK>>`` and the backward's), the mma.sync tensor-core forward
(``cuflash_fwd_mma_var<..., CAUSAL, V>``, attn_mma.cu) and the Hopper forward
(``cuflash_fwd_wgmma_var<..., CAUSAL, V[, OP]>``, attn_wgmma.cu). Forward: ``kernel="auto"``
takes the Hopper kernel where `hopper_variant_reason` allows and HOPPER_VARIANTS_AUTO is on (off
until its GPU run), else the tensor-core kernel where the inputs qualify
(`tensorcore_variant_reason`), else the generic one, whose label says why;
``kernel="tensorcore"`` / ``"hopper"`` demand theirs and raise ValueError saying why not.
Backward: the mma.sync tensor-core backward (``cuflash_bwd_mma_var<..., OPT, V>``,
attn_bwd_mma.cu) where `bwd_tensorcore_variant_reason` says the inputs qualify (float16 /
bfloat16, the head dims of `_dispatch.TC_BWD_CONFIGS`), else the generic variant kernels;
`variant_backward_fallback_reason` says why ``kernel="auto"`` fell back.
"""
from __future__ import annotations

from ._dispatch import _CXX_TYPE, Plan, Specialisation


#: softcap's reciprocal on the FMA pipe (variants.cuh: rcp_fma, ``SC_FORM = 1``) instead of the
#: MUFU's rcp.approx in the fast softcap of the tensor-core kernels (the mma.sync and Hopper
#: forwards, the mma.sync backward: one policy type for all, so the backward recomputes the
#: forward's logits with the same instructions). Two MUFU operations per softcapped score instead
#: of three, 7 more FMA-pipe ones (notes/VARIANTS.md, "softcap's MUFU budget"). Off until the
#: H200 measures it against the MUFU form (benchmarks/bench_variants.py --softcap-forms).
SOFTCAP_RCP_FMA = False

#: The softmax scale fused into the variant's transform in the tensor-core kernels (variants.cuh:
#: score_x, ``FORM`` bit 2): softcap's exponent takes the raw product (one FMUL fewer per score),
#: ALiBi's and a bias's addition is one FFMA with it (ALiBi under causal without |.|: two FMA-pipe
#: instructions per score instead of three), and a policy without a transform (window, mask) keeps
#: raw scores and the plain kernel's softmax units (no FMUL per score). Not for user hooks. Off:
#: the complete GPU suite passed with it (H200, 2026-12-02, session i) and the Hopper forward
#: gained a little per visited tile against plain (session g, call 3: ALiBi 0.88 -> 0.90, window
#: 0.88 -> 0.92, softcap 0.65 either way; benchmarks/bench_variants.py --impl base,fused), but
#: under NVRTC 13.5 the mma.sync backward's float16 D = 128 causal window + softcap + ALiBi form
#: spilled (255 registers, 4 / 12 B): that backward now keeps the unfused form for policies of
#: two or more transforms at D = 128 (TC_BWD_FUSED_LIMIT_D, `fused_form`). On since session j
#: (H200, 2026-12-03): all 208 form and dispatch GPU cases passed with that rule, the window
#: measured 0.92 per visited tile and the variants' backward was unchanged (0.47 per tile).
VARIANT_FUSED_SCALE = True

#: ALiBi in the softmax's affine units on the Hopper forward (variants.cuh: Variant::affine,
#: affine_scores_as; common.cuh: softmax_step_affine; FORM bit 4): under causal the score is
#: slope y + (a term of the row and tile), y = x (scale / slope) + the key's constant offset, one
#: FFMA per score (the fused form: two, the default: three); the softmax runs in log2 units with
#: a = slope log2 e. For ALiBi without softcap, bias or window (registers; a mask may join),
#: 16-bit inputs, causal, where 2^-10 <= slope <= 1 (else the kernel takes the policy's other
#: form, per batch entry). Its y = x scale / slope overflows for |q.k| over ~5e36 at D = 256
#: (bfloat16 only), where the other forms stay finite to 3e38.
#: On since the complete GPU suite passed with it (H200, 2026-12-02, session i): ALiBi per visited
#: tile against plain 0.97 (the default form 0.88; session g, call 3, bench_variants.py --impl
#: affine).
ALIBI_AFFINE = True

#: Where the mma.sync backward keeps the unfused form under VARIANT_FUSED_SCALE: from this padded
#: head dim on, a policy with more than TC_BWD_FUSED_MAX_TRANSFORMS transforms (softcap, ALiBi, a
#: bias: the score's parts that change t) takes FORM without bit 2 there (`fused_form`). At D = 128
#: its registers sit at 241-255 (the dK and dV accumulators alone take 128), and fused policies
#: with two or more transforms spilled under NVRTC 13.5 (sm_90, 4 / 12 B at 255 registers): window
#: + softcap + ALiBi causal, float16 and bfloat16 deterministic (softcap + ALiBi + mask under
#: causal spills 28-56 B in either form); every fused policy with one transform, and every
#: unfused one the compile set holds, compiles clean. The forwards keep the fused form, so
#: forward and backward then recompute the logits with different roundings (notes/VARIANTS.md).
TC_BWD_FUSED_LIMIT_D = 128
TC_BWD_FUSED_MAX_TRANSFORMS = 1

#: User hooks (score_mod / mask_mod) on the Hopper backward, D = 65..256, under the built-in
#: parts' rules of `hopper_bwd_variant_reason` (session r, 2026-12-06). Before, every hook at
#: D > 64 on sm_90 went to the generic scalar backward: S = 16k, B = 2, H = 16, D = 128, causal,
#: float16 on an H100, a window or a document mask as mask_mod took 1180-1202 ms there against
#: FlexAttention's 6.1 / 3.4 ms (benchmarks/RESULTS.md, "session r"). The kernel's registers sit
#: at 236-255 with a hook, and a hook's own code can spill: under NVRTC 13.5 the example hooks
#: compile clean except rel_bias at D = 128 causal (12 B) and tanh_cap at D = 256 non-causal
#: deterministic (4 B); tanh_cap + document + window + ALiBi at D = 256 spills 12-40 B. A spill
#: costs speed, not correctness, and the generic kernel it replaces is ~100x slower, so the
#: hook is taken all the same; the compile set holds the forms that compile clean.
HOPPER_BWD_HOOKS = True


def transforms(variant) -> int:
    """How many of the score's transforms the variant has (softcap, ALiBi, a bias: variants.cuh's
    Variant::TRANSFORMS parts; a window or a mask only hides keys)."""
    return (bool(variant.softcap) + (variant.alibi_slopes is not None)
            + (variant.bias is not None))


def fused_form(variant, bwd_dpad=None) -> bool:
    """Whether a tensor-core policy takes VARIANT_FUSED_SCALE's form (FORM bit 2): the flag on, no
    user hooks, and for the mma.sync backward (`bwd_dpad`: its padded head dim; None: a forward)
    below TC_BWD_FUSED_LIMIT_D or with at most TC_BWD_FUSED_MAX_TRANSFORMS transforms."""
    if not VARIANT_FUSED_SCALE or getattr(variant, "has_mods", False):
        return False
    return (bwd_dpad is None or bwd_dpad < TC_BWD_FUSED_LIMIT_D
            or transforms(variant) <= TC_BWD_FUSED_MAX_TRANSFORMS)


def _affine(variant, fast, hopper) -> bool:
    """Whether the policy takes ALIBI_AFFINE's form (FORM bit 4): `hopper` = the Hopper forward
    with causal and 16-bit inputs, where its kernel uses it (attn_wgmma.cu: AFF)."""
    return (fast and hopper and ALIBI_AFFINE and variant.alibi_slopes is not None
            and not variant.softcap and variant.bias is None and not variant.has_window
            and not getattr(variant, "has_mods", False))


#: Whether the forwards (generic, mma.sync, Hopper) narrow the key tiles of a policy with a
#: mask_mod to the keys its block summary does not hide (variants.cuh: UserVariant's BLOCKS;
#: `_mask_blocks.hook_summary` and `hook_ranges`, made per call on its stream): a document or
#: window mask_mod then costs about its visible pairs, not every pair under the causal limit.
#: Off: built in session s without a GPU; its first GPU run (session t, H200) measured the
#: window and document hook forwards 2.6x and 5.5x faster, and its GPU test
#: (tests/test_mods_gpu.py::test_hook_blocks_forward) failed on two defects of the test itself
#: (fixed since, not rerun: notes/VARIANTS.md).
HOOK_BLOCKS = False
#: With HOOK_BLOCKS, the backwards without deterministic turns narrow too: each key block visits
#: the query tiles of the rows the summary does not hide from it (UserVariant::row_range from the
#: key blocks' row ranges) and skips the hook on tiles it keeps entirely. The deterministic
#: backwards keep the full walk: their turn chains assume that every key block in a query tile's
#: key range visits it (`key_range` and `row_range` describe the same relation), which the
#: summary's hulls do not give. Off: built in session t without a GPU.
HOOK_BLOCKS_BWD = False


def hook_blocks(variant, backward: bool = False) -> bool:
    """Whether a policy for `variant` takes UserVariant's BLOCKS (HOOK_BLOCKS; for a backward
    without deterministic turns, HOOK_BLOCKS_BWD too)."""
    return (HOOK_BLOCKS and getattr(variant, "mask_mod", None) is not None
            and (not backward or HOOK_BLOCKS_BWD))


def reads_hook_ranges(plan) -> bool:
    """Whether `plan`'s kernel reads a mask_mod's key ranges (VariantParams::mod_ranges)."""
    return "hook-blocks" in plan.label


def policy_name(variant, fast: bool = True, hopper: bool = False, bwd_dpad=None,
                blocks: bool = False) -> str:
    """The C++ policy type of a `cuflash.variants.Variant`, e.g.
    ``cuflash::Variant<true, false, false, cuflash::NoBias, false>`` (with softcap under
    SOFTCAP_RCP_FMA and / or VARIANT_FUSED_SCALE a sixth argument, the FORM bits 1 / 2 of
    variants.cuh; not for the generic kernels, ``fast=False``, whose softcap is tanh in the
    accumulator type and whose scores are scaled in it). `bwd_dpad`: the mma.sync backward's
    padded head dim, where `fused_form` may keep the unfused form. `blocks`: True for a
    forward, "bwd" for a backward without deterministic turns, which narrow their tiles by the
    mask_mod's ranges where `hook_blocks` says so."""
    b = "true" if variant.has_window else "false"
    s = "true" if variant.softcap else "false"
    a = "true" if variant.alibi_slopes is not None else "false"
    m = "true" if variant.mask is not None else "false"
    bias = ("cuflash::NoBias" if variant.bias is None
            else _CXX_TYPE[_dtype_name(variant.bias.dtype)])
    hooks = getattr(variant, "has_mods", False)
    bits = (((1 if variant.softcap and SOFTCAP_RCP_FMA else 0)
             | (2 if fused_form(variant, bwd_dpad) else 0)) if fast else 0)
    bits |= 4 if _affine(variant, fast, hopper) else 0
    form = f", {bits}" if bits else ""
    base = f"cuflash::Variant<{b}, {s}, {a}, {bias}, {m}{form}>"
    if not hooks:
        return base
    from .mods import hook_type   # user hooks wrap the built-in policy (variants.cuh)
    sm = "true" if variant.score_mod is not None else "false"
    mm = "true" if variant.mask_mod is not None else "false"
    nb = ", true" if blocks and hook_blocks(variant, backward=blocks == "bwd") else ""
    return (f"cuflash::UserVariant<{base}, {hook_type(variant.score_mod, variant.mask_mod)}, "
            f"{sm}, {mm}{nb}>")


def _hook_source(variant) -> str:
    """The generated hook struct a specialisation's source needs ("" without hooks)."""
    if not getattr(variant, "has_mods", False):
        return ""
    from .mods import hook_source
    return hook_source(variant.score_mod, variant.mask_mod)


def _dtype_name(dt):
    import numpy as np
    return np.dtype(dt).name


def policy_label(variant, fast: bool = True, hopper: bool = False, bwd_dpad=None,
                 blocks: bool = False) -> str:
    """The variant's parts for a plan label, e.g. ``window,softcap,bias<float16>`` (and the forms
    `policy_name` gives the same arguments, e.g. ``fused-scale``)."""
    parts = []
    if variant.has_window:
        parts.append("window")
    if variant.softcap:
        parts.append("softcap<fma-rcp>" if SOFTCAP_RCP_FMA and fast else "softcap")
    if variant.alibi_slopes is not None:
        parts.append("alibi")
    if variant.bias is not None:
        parts.append(f"bias<{_dtype_name(variant.bias.dtype)}>")
    if variant.mask is not None:
        parts.append("mask")
    for name, hook in (("score_mod", variant.score_mod), ("mask_mod", variant.mask_mod)):
        if hook is not None:   # user hooks, named by their code's hash
            parts.append(f"{name}[{hook.digest[:8]}]")
    if blocks and hook_blocks(variant, backward=blocks == "bwd"):
        parts.append("hook-blocks")
    if fast and fused_form(variant, bwd_dpad):
        parts.append("fused-scale")
    if _affine(variant, fast, hopper):
        parts.append("alibi-affine")
    return ",".join(parts)


def generic_variant_plan(dtype_name: str, d: int, dv: int, causal: bool, variant,
                         reason: str = "") -> Plan:
    """The generic forward kernel with the variant's policy (attn_generic.cu:
    cuflash_fwd_generic_var); the same configuration as the plain generic plan."""
    import dataclasses

    from ._dispatch import generic_plan

    base = generic_plan(dtype_name, d, dv, causal)
    name = (base.spec.name.replace("cuflash_fwd_generic<", "cuflash_fwd_generic_var<")[:-1]
            + f", {policy_name(variant, fast=False, blocks=True)}>")
    label = (base.label[:-1] + f",{policy_label(variant, fast=False, blocks=True)}>"
             + (f" ({reason})" if reason else ""))
    return dataclasses.replace(base, label=label, spec=Specialisation(
        base.spec.family, name, extra_source=_hook_source(variant)))


#: Tile configs of the tensor-core forward with a variant, in the format of
#: `_dispatch.TC_CONFIGS`, {(dpad, reads tensors): config} for 16-bit inputs; absent: the plain
#: kernel's. The per-element work of a policy (its reads and their addresses, the masks) needs
#: registers the plain configs do not leave (NVRTC 13.0 and 13.5, sm_90, 2026-12-01): at D = 64
#: window, softcap and ALiBi fit the plain four blocks per SM (120-128 registers), a float32 bias
#: or a mask spilled 4-24 bytes there and 12-40 at three blocks, user hooks 250; two blocks per SM
#: fit (181-204 registers). At D = 96 / 128 the plain configs (two m-tiles a warp) sit at 250
#: registers: every part combined spilled 388 bytes at D = 128, so variants take one m-tile a
#: warp (BM = 64). At D = 192 / 256 (O alone 96-128 registers) they take 32-key tiles.
TC_VARIANT_CONFIGS = {
    (64, True): (64, 4, 1, 2, True),
    (96, False): (64, 4, 1, 2, True), (96, True): (64, 4, 1, 2, True),
    (128, False): (64, 4, 1, 2, True), (128, True): (64, 4, 1, 2, True),
    (192, False): (32, 4, 1, 2, True), (192, True): (32, 4, 1, 2, True),
    (256, False): (32, 4, 1, 2, True), (256, True): (32, 4, 1, 2, True),
}
#: User hooks (16-bit inputs), {dpad: config}, before TC_VARIANT_CONFIGS: both hooks on every
#: built-in part at D = 128 spilled 40 bytes at 64-key tiles under NVRTC 13.0 (255 registers).
TC_HOOK_CONFIGS = {96: (32, 4, 1, 2, True), 128: (32, 4, 1, 2, True)}
#: float32 (TF32) inputs, {(dpad, precision, reads tensors): config}; absent: the plain one's.
TC_F32_VARIANT_CONFIGS = {}


def variant_reads(variant) -> bool:
    """Whether the policy reads tensors per element (variants.cuh: READS, ALiBi's slope aside)."""
    return (variant.bias is not None or variant.mask is not None
            or getattr(variant, "has_mods", False))


def tensorcore_variant_plan(dtype_name: str, d: int, causal: bool, compute_capability: int,
                            variant, precision: str = "highest") -> Plan:
    """The mma.sync forward with the variant's policy (attn_mma.cu: cuflash_fwd_mma_var): the
    plain tensor-core plan with the tiles of `TC_VARIANT_CONFIGS` (registers) where it has
    them."""
    import dataclasses

    from ._dispatch import F32_TERMS, tensorcore_plan

    reads = variant_reads(variant)

    def config(dpad, plain):
        if dtype_name == "float32":
            return TC_F32_VARIANT_CONFIGS.get((dpad, precision, reads), plain)
        if getattr(variant, "has_mods", False) and dpad in TC_HOOK_CONFIGS:
            return TC_HOOK_CONFIGS[dpad]
        return TC_VARIANT_CONFIGS.get((dpad, reads), plain)

    # float32: the TF32 forms (cuflash_fwd_mma_var has no fp16-split form, whatever TC_F32_FORM)
    form = F32_TERMS[precision][1] if dtype_name == "float32" else None
    base = tensorcore_plan(dtype_name, d, causal, compute_capability, precision, config=config,
                           form=form)
    name = (base.spec.name.replace("cuflash_fwd_mma<", "cuflash_fwd_mma_var<")[:-1]
            + f", {policy_name(variant, blocks=True)}>")
    label = base.label[:-1] + f",{policy_label(variant, blocks=True)}>"
    return dataclasses.replace(base, label=label, spec=Specialisation(
        base.spec.family, name, extra_source=_hook_source(variant)))


def tensorcore_variant_reason(prob, compute_capability) -> "str | None":
    """Why the tensor-core forward cannot run these inputs with their variant (None: it can):
    the plain kernel's conditions (`_dispatch.tensorcore_reason`), and bias / mask tensors whose
    last axis is contiguous or broadcast (variants.cuh: score_tc, visible_tc read column j or
    0). Every variant part and user hook is supported there."""
    from ._dispatch import tensorcore_reason
    why = tensorcore_reason(prob, compute_capability)
    if why is not None:
        return why
    return _column_stride_reason(prob.variant)


def _column_stride_reason(variant) -> "str | None":
    """Why the tensor-core kernels cannot read the variant's bias / mask (variants.cuh:
    score_tc, visible_tc read column j or 0: a column stride of 0 or 1 element), or None."""
    for name in ("bias", "mask"):
        x = getattr(variant, name, None)
        if x is not None and x.shape[-1] > 1 and x.strides[-1] not in (0, x.itemsize):
            return (f"it reads {name} with a column stride of 0 or 1 element (got "
                    f"{x.strides[-1] // x.itemsize}); pass a {name} contiguous along its last "
                    "axis")
    return None


#: Whether kernel="auto" takes the Hopper forward (attn_wgmma.cu: cuflash_fwd_wgmma_var) for a
#: variant on compute capability 9.0 where `hopper_variant_reason` says it qualifies. On since
#: the H200 run of 2026-12-02 (session f): tests/test_variants_gpu.py and test_mods_gpu.py passed
#: through it (kernel="hopper"), and at S = 16k it ran softcap, ALiBi, window and bias 1.7-2.2x
#: faster than the mma.sync kernel auto took before (benchmarks/RESULTS.md, "session f").
HOPPER_VARIANTS_AUTO = True

#: Tiles of the Hopper forward with a variant (16-bit inputs), {(padded head dim, reads
#: tensors): HopperTiles fields to replace}, where the plain table's (HOPPER_TABLE) do not fit:
#: three consumers (BM = 192) leave each 160 registers (attn_wgmma.cu: WgmmaConfig), too few for
#: a policy's per-element work (notes/VARIANTS.md, "The Hopper forward with a policy").
#: NVRTC 13.0, sm_90a, every part combined: the plain tiles spilled 132 bytes at D = 64 (BN = 128,
#: two consumers) and 332 at D = 128 with a bias and a mask, 12 with the positional parts at
#: D = 128, BN = 176, 40-440 at D = 256 (BN = 80; 4-308 still at BN = 64 with the overlapped
#: softmax, 64 with a bias and a mask without it): hence 64-key tiles where the policy reads
#: tensors, 128 keys at D = 128 without, and at D = 256 no overlapped softmax (P_{j-1} and S_j in
#: registers at once) with 64-key tiles, 32 where the policy reads tensors.
HOPPER_VARIANT_TILES = {
    (64, False): dict(consumers=2), (64, True): dict(consumers=2, bn=64),
    (128, False): dict(bn=128), (128, True): dict(bn=64),
    (256, False): dict(bn=64, overlap=False), (256, True): dict(bn=32, overlap=False),
}
#: The same for float32, {(padded head dim, precision, reads tensors): fields}: one-pass TF32
#: ("high") with a bias or a mask spilled 524 bytes at D = 64 (128 still without the overlapped
#: softmax, none with 64-key tiles too) and 84 at D = 128 with the overlapped softmax; window,
#: softcap and ALiBi under causal 76 bytes at D = 64 with 128-key tiles (none with 64). (The 3xfp16 form of "highest" has none and fits as it is.)
HOPPER_VARIANT_F32_TILES = {(64, "high", False): dict(bn=64),
                            (64, "high", True): dict(overlap=False, bn=64),
                            (128, "high", True): dict(overlap=False)}


#: User hooks on the Hopper forward, {padded head dim: HopperTiles fields}, applied after the
#: tables above (every dtype and form; hooks count as reads there): both example hooks on every
#: built-in part at D = 128 spilled 108-156 bytes with 64-key tiles (40 without the overlapped
#: softmax) under NVRTC 13.0, none with 32-key tiles; D = 64 and D = 256 fit the reads' tiles.
HOPPER_HOOK_TILES = {128: dict(bn=32)}

#: Wider tiles for the lighter hook policies on the 16-bit Hopper forward (`hook_tiles`; session
#: r, 2026-12-06): a mask_mod with no built-in part and no score_mod takes the tiles of a policy
#: that reads nothing (128 keys at D = 64 and 128), and at D = 128 a policy with a score_mod or
#: positional parts (window, softcap, ALiBi) but no bias or mask tensor 64 keys. Compiled under
#: NVRTC 13.0 and 13.5 (sm_90a, float16 and bfloat16, causal and not), none spilled: document
#: and prefix_lm alone at 128 keys (D = 64, 128), tanh_cap, rel_bias, rel_bias + document,
#: tanh_cap + document + window + softcap + ALiBi and rel_bias + prefix_lm + the same at 64 keys
#: (D = 128); what did spill is why the rule stops there: a mask_mod with the positional parts
#: at 128 keys (92-300 B), ALiBi as a score_mod at 128 keys and D = 128 (36-64 B). Off: every hook
#: policy at D = 128 takes 32-key tiles, as before (bench_variants.py --impl narrowhooks).
HOPPER_HOOK_WIDE = True


def hook_tiles(dtype_name: str, dpad: int, variant) -> "tuple[bool, dict]":
    """(reads, HopperTiles fields) of a hook policy's Hopper forward tiles: `reads` picks the
    HOPPER_VARIANT_TILES row, the fields are replaced after it (HOPPER_HOOK_WIDE's rule, else
    HOPPER_HOOK_TILES)."""
    tensors = variant.bias is not None or variant.mask is not None
    builtin = (tensors or variant.has_window or bool(variant.softcap)
               or variant.alibi_slopes is not None)
    if HOPPER_HOOK_WIDE and dtype_name != "float32":
        # (HOOK_BLOCKS' narrowed walk at D = 128 and 128 keys spilled 68-72 B under causal:
        # such a mask_mod takes 64 keys there)
        if variant.score_mod is None and not builtin and dpad in (64, 128) \
                and not (dpad == 128 and hook_blocks(variant)):
            return False, {}
        if dpad == 128 and not tensors:
            return True, dict(bn=64)
    return True, HOPPER_HOOK_TILES.get(dpad, {})


def hopper_variant_plan(dtype_name: str, d: int, causal: bool, sk: int, variant,
                        precision: str = "highest", sq=None) -> Plan:
    """The Hopper forward with the variant's policy (attn_wgmma.cu: cuflash_fwd_wgmma_var): the
    plain Hopper plan (hopper_plan, HOPPER_TABLE and the float32 forms' tables) with the
    tiles of HOPPER_VARIANT_TILES, ``_var<..., CAUSAL, V[, OP]>`` in the kernel's name
    and the variant's parts in the label."""
    import dataclasses

    from ._dispatch import hopper_plan

    reads = variant_reads(variant)
    hooks = getattr(variant, "has_mods", False)

    def choose(dpad, cfg, persistent):
        tile_reads, hook_fields = hook_tiles(dtype_name, dpad, variant) if hooks else (reads, {})
        if dtype_name == "float32":
            cfg = cfg._replace(**HOPPER_VARIANT_F32_TILES.get((dpad, precision, reads), {}))
        else:
            cfg = cfg._replace(**HOPPER_VARIANT_TILES.get((dpad, tile_reads), {}))
        return cfg._replace(**hook_fields), persistent

    base = hopper_plan(dtype_name, d, causal, sk, precision, sq=sq, choose=choose)
    name = base.spec.name.replace("cuflash_fwd_wgmma<", "cuflash_fwd_wgmma_var<")
    op = ", cuflash::fp16_t>"
    aff = causal and dtype_name != "float32"   # where ALIBI_AFFINE's form applies (attn_wgmma.cu)
    pol = policy_name(variant, hopper=aff, blocks=True)
    name = (name[:-len(op)] + f", {pol}{op}" if name.endswith(op) else name[:-1] + f", {pol}>")
    label = base.label[:-1] + f",{policy_label(variant, hopper=aff, blocks=True)}>"
    return dataclasses.replace(base, label=label, spec=Specialisation(
        base.spec.family, name, arch=base.spec.arch, extra_source=_hook_source(variant)))


def hopper_variant_reason(prob, compute_capability) -> "str | None":
    """Why the Hopper forward cannot run these inputs with their variant (None: it can): the
    plain Hopper kernel's conditions (`_dispatch.hopper_reason`) and bias / mask tensors read
    with a column stride of 0 or 1. Every built-in part and user hook is supported there."""
    from ._dispatch import hopper_reason
    why = hopper_reason(prob, compute_capability)
    if why is not None:
        return why
    if prob.dtype_name == "float32" and prob.d > 128:  # _dispatch.HOPPER_F32_D256 on
        return ("its float32 form above D = 128 (two consumers sharing the head dim) has no "
                "variant policies yet")
    return _column_stride_reason(prob.variant)


def hopper_variant_compile_specs():
    """The Hopper forward's variant specialisations the compile check builds (sm_90a): for
    float16 at D64 every part alone (bias in float16 and float32), window and the five parts
    combined with and without causal, the positional parts (window, softcap, ALiBi) combined
    under causal; at D128 and D256 the positional parts and all five, with and without causal;
    bfloat16 all five at D128 (causal and not); float32 (3xfp16 "highest" and one-pass TF32
    "high") the positional parts and all five at D64 and D128 under causal, and every form
    tests/test_variants_gpu.py runs on the Hopper kernel (its cases at D64, the window tests at
    D64 and D128, the head-dim tests)."""
    out = []

    def add(dt, d, causal, pol, precision="highest"):
        spec = hopper_variant_plan(dt, d, causal, 1024, pol, precision).spec
        if spec not in out:
            out.append(spec)

    every = _Spec(window=True, softcap=True, alibi=True, bias="float32", mask=True)
    positional = _Spec(window=True, softcap=True, alibi=True)
    for dt in ("float16", "float32"):   # tests/test_variants_gpu.py: the Hopper cases
        _add_d64_forms(add, dt)
    for d in (128, 256):
        for causal in (False, True):
            add("float16", d, causal, positional)
            add("float16", d, causal, every)
    for causal in (False, True):
        add("bfloat16", 64, causal, every)
        add("bfloat16", 128, causal, every)
    for d in (64, 128):
        for precision in ("highest", "high"):
            add("float32", d, True, positional, precision)
            add("float32", d, True, every, precision)
    # the window tests' and head-dim tests' other forms
    add("bfloat16", 64, True, _Spec(window=True))
    for causal in (False, True):
        add("float16", 128, causal, _Spec(window=True))
    add("bfloat16", 256, False, _Spec(softcap=True))
    # user hooks: mod_compile_specs' cases, and those tests/test_mods_gpu.py runs on the Hopper
    # kernel (its hooks from cuflash.mods.example_hooks)
    from .mods import example_hooks
    ex = example_hooks()
    cap, rel, doc = ex["tanh_cap"], ex["rel_bias"], ex["document"]
    for dt, precision in (("float16", "highest"), ("bfloat16", "highest"),
                          ("float32", "highest"), ("float32", "high")):
        for pol, causal, d in ((_with_mods(_Spec(), cap, None), False, 64),
                               (_with_mods(_Spec(), rel, doc), True, 64),
                               (_with_mods(_Spec(window=True, alibi=True), cap, doc), True, 64),
                               (_with_mods(_Spec(), None, doc), True, 64),
                               (_with_mods(_Spec(window=True, softcap=True, alibi=True,
                                                 bias="float32", mask=True), cap, doc),
                                True, 128)):
            add(dt, d, causal, pol, precision)
    add("float16", 64, True, _with_mods(_Spec(), cap, None))
    add("float16", 64, True, _with_mods(_Spec(), rel, None))
    add("float16", 256, True, _with_mods(_Spec(window=True, softcap=True, alibi=True,
                                               bias="float32", mask=True), cap, doc))
    # HOPPER_HOOK_WIDE's tiles at D = 128 (and D = 64's mask_mod alone), as
    # test_mods_gpu.py::test_hooks_hopper_backward runs them, and the bench's hook rows
    pre = ex["prefix_lm"]
    for dt, causal, pol in (("float16", True, _with_mods(_Spec(), cap, None)),
                            ("bfloat16", False, _with_mods(_Spec(), rel, None)),
                            ("float16", True, _with_mods(_Spec(), None, doc)),
                            ("float16", False, _with_mods(_Spec(), None, doc)),
                            ("float16", True, _with_mods(_Spec(window=True, alibi=True),
                                                         cap, doc)),
                            ("bfloat16", True, _with_mods(_Spec(), rel, doc))):
        add(dt, 128, causal, pol)
    add("float16", 64, False, _with_mods(_Spec(), None, pre))
    add("float16", 256, True, _with_mods(_Spec(), rel, None))
    add("bfloat16", 256, False, _with_mods(_Spec(), None, pre))
    return out


def variant_plan_for(prob, compute_capability=None) -> Plan:
    """The forward plan of a problem with a variant (``prob.variant`` not None) on a device of
    this compute capability: for ``kernel="auto"`` the Hopper kernel where it qualifies and
    HOPPER_VARIANTS_AUTO is on (for float32, _dispatch.HOPPER_F32_AUTO too), else the tensor-core kernel where it qualifies, else the generic
    one. kernel="hopper" takes the Hopper kernel or raises saying why not; kernel="decode" (no
    policy) raises, naming the variant."""
    if prob.kernel == "decode":  # the kernel family without the policy yet
        hooks = prob.variant.hook_names() if getattr(prob.variant, "has_mods", False) else []
        what = (f"the user hook{'s' if len(hooks) > 1 else ''} {' and '.join(hooks)}" if hooks
                else f"the attention variant ({policy_label(prob.variant, fast=False)})")
        raise ValueError(f"kernel={prob.kernel!r} cannot run these inputs: {what} is not "
                         "supported there yet; use kernel='auto', 'tensorcore' or 'generic'")
    from . import _dispatch
    auto = HOPPER_VARIANTS_AUTO and (_dispatch.HOPPER_F32_AUTO or prob.dtype_name != "float32")
    if prob.kernel == "hopper" or (prob.kernel == "auto" and auto):
        why_not = hopper_variant_reason(prob, compute_capability)
        if why_not is None:
            return hopper_variant_plan(prob.dtype_name, prob.d, prob.causal, prob.sk,
                                       prob.variant, getattr(prob, "precision", "highest"),
                                       sq=prob.sq)
        if prob.kernel == "hopper":
            raise ValueError(f"kernel='hopper' cannot run these inputs with "
                             f"{_variant_words(prob.variant)}: {why_not}; use kernel='auto', "
                             "'tensorcore' or 'generic'")
    reason = ""
    if prob.kernel in ("auto", "tensorcore"):
        why_not = tensorcore_variant_reason(prob, compute_capability)
        if why_not is None:
            return tensorcore_variant_plan(prob.dtype_name, prob.d, prob.causal,
                                           compute_capability, prob.variant,
                                           getattr(prob, "precision", "highest"))
        if prob.kernel != "auto":
            raise ValueError(f"kernel={prob.kernel!r} cannot run these inputs with the attention "
                             f"variant ({policy_label(prob.variant, fast=False)}): {why_not}")
        reason = f"the tensor-core kernel cannot run them: {why_not}"
    return generic_variant_plan(prob.dtype_name, prob.d, prob.dv, prob.causal, prob.variant,
                                reason)


class _Spec:
    """A stand-in Variant for compile checks (only which parts are on matters)."""

    def __init__(self, window=False, softcap=False, alibi=False, bias=None, mask=False):
        import numpy as np
        self.has_window, self.softcap = window, 1.0 if softcap else 0.0
        self.alibi_slopes = np.zeros(1, np.float32) if alibi else None
        self.bias = None if bias is None else np.zeros(1, dtype=_np_dtype(bias))
        self.mask = np.zeros(1, bool) if mask else None
        self.score_mod = self.mask_mod = None
        self.has_mods = False


def _np_dtype(name):
    import numpy as np
    if name == "bfloat16":
        import ml_dtypes
        return ml_dtypes.bfloat16
    return np.dtype(name)


def _compile_policies(dt):
    """(policy, causal) pairs of the compile check for one dtype: every part alone (full mask)
    and the combination of all five parts, with and without causal."""
    bias = "float32" if dt != "float64" else "float64"
    every = _Spec(window=True, softcap=True, alibi=True, bias=bias, mask=True)
    alone = [_Spec(window=True), _Spec(softcap=True), _Spec(alibi=True), _Spec(bias=bias),
             _Spec(mask=True)]
    return [(pol, False) for pol in alone] + [(every, False), (every, True)]


def variant_compile_specs():
    """The forward variant specialisations the compile check builds (D64; the combination also
    at D128 and D256, where registers are tightest)."""
    out = []
    for dt in ("float16", "bfloat16", "float32", "float64"):
        for pol, causal in _compile_policies(dt):
            out.append(generic_variant_plan(dt, 64, 64, causal, pol).spec)
        every = _compile_policies(dt)[-1][0]
        for db in (128, 256):
            out.append(generic_variant_plan(dt, db, db, True, every).spec)
    return out


def bwd_generic_variant_plan(dtype_name: str, d: int, dv: int, causal: bool, variant,
                             reason: str = ""):
    """The generic backward with the variant's policy: the plain generic plan's configuration,
    its dq and dk/dv passes as cuflash_bwd_dq_generic_var / cuflash_bwd_dkdv_generic_var."""
    import dataclasses

    from ._dispatch import bwd_generic_plan

    base = bwd_generic_plan(dtype_name, d, dv, causal)   # (no deterministic turns: atomics-free)
    pol = policy_name(variant, fast=False, blocks="bwd")
    tag = policy_label(variant, fast=False, blocks="bwd")
    passes = []
    for grid, plan in base.passes:
        name = plan.spec.name.replace("_generic<", "_generic_var<")[:-1] + f", {pol}>"
        passes.append((grid, dataclasses.replace(
            plan, label=plan.label[:-1] + f",{tag}>",
            spec=Specialisation(plan.spec.family, name,
                                extra_source=_hook_source(variant)))))
    label = base.label[:-1] + f",{tag}>" + (f" ({reason})" if reason else "")
    return dataclasses.replace(base, label=label, passes=tuple(passes))


def _variant_words(variant) -> str:
    """The variant as an error message names it: its parts, and its user hooks by name."""
    hooks = variant.hook_names() if getattr(variant, "has_mods", False) else []
    # (fast=False: the parts only, not the form a tensor-core kernel would have taken)
    what = f"the attention variant ({policy_label(variant, fast=False)})"
    if hooks:
        what += f" with the user hook{'s' if len(hooks) > 1 else ''} {' and '.join(hooks)}"
    return what


#: Tile configs of the tensor-core backward with a variant, {(dpad, reads tensors): config} in
#: the format of `_dispatch.TC_BWD_CONFIGS`; absent: the plain kernel's (registers: see
#: notes/VARIANTS.md, "The tensor-core backward with a policy"). At D = 128 the plain kernel's
#: lean bookkeeping (OPT bit 1: the next tile's lse / delta held in registers) left no room:
#: softcap alone and every part combined spilled 4-40 bytes at 255 registers (NVRTC 13.0 and
#: 13.5, sm_90), and with the late deterministic hand-over (bit 2) every part combined still
#: spilled 12-20 bytes under NVRTC 13.0: variants there keep the plain tiles with OPT = 0.
TC_BWD_VARIANT_CONFIGS = {(128, False): (32, 8, 2, 1), (128, True): (32, 8, 2, 1)}
#: User hooks, {dpad: config}, before TC_BWD_VARIANT_CONFIGS: a score_mod reading its args with
#: a mask_mod (the compile check's rel_bias + document) spilled 28-72 bytes at 255 registers on
#: the plain tiles under NVRTC 13.0 and 13.5 (sm_90); at D = 64 half the query rows per tile
#: (BM = 32: half of P^T and of d score / d t in registers) fit. At D = 128 (dK, dV alone take
#: 128 registers) it still spilled 24-76 bytes with BM = 32 and one Q/dO stage, so hooks take
#: the tensor-core backward up to TC_BWD_HOOK_MAX_D only.
TC_BWD_HOOK_CONFIGS = {64: (32, 4, 2, 2)}
TC_BWD_HOOK_MAX_D = 64


def bwd_tensorcore_variant_plan(dtype_name: str, d: int, causal: bool, deterministic: bool,
                                compute_capability: int, variant):
    """The mma.sync backward with the variant's policy (attn_bwd_mma.cu: cuflash_bwd_mma_var):
    the plain tensor-core backward plan (its preprocess and dq conversion; the tiles of
    `TC_BWD_VARIANT_CONFIGS` where it has them) with ``_var<..., V>`` in the kernel's name and
    the variant's parts in the labels; under VARIANT_FUSED_SCALE the fused form where
    `fused_form` takes it at this head dim (TC_BWD_FUSED_LIMIT_D), else the unfused one."""
    import dataclasses

    from . import _dispatch

    reads = variant_reads(variant)
    hooks = getattr(variant, "has_mods", False)

    def config(dpad, plain):
        if hooks and dpad in TC_BWD_HOOK_CONFIGS:
            return TC_BWD_HOOK_CONFIGS[dpad]
        return TC_BWD_VARIANT_CONFIGS.get((dpad, reads), plain)

    base = _dispatch.bwd_tensorcore_plan(dtype_name, d, causal, deterministic,
                                         compute_capability, config=config)
    dpad = _dispatch.head_dim_bucket(d, _dispatch.TC_BWD_CONFIGS)   # (bwd_tensorcore_plan's)
    blocks = False if deterministic else "bwd"   # (the turn chains: HOOK_BLOCKS_BWD)
    pol = policy_name(variant, bwd_dpad=dpad, blocks=blocks)
    tag = policy_label(variant, bwd_dpad=dpad, blocks=blocks)
    passes = []
    for grid, plan in base.passes:
        if "cuflash_bwd_mma<" in plan.spec.name:
            name = (plan.spec.name.replace("cuflash_bwd_mma<", "cuflash_bwd_mma_var<")[:-1]
                    + f", {pol}>")
            plan = dataclasses.replace(plan, label=plan.label[:-1] + f",{tag}>",
                                       spec=Specialisation(plan.spec.family, name,
                                                           extra_source=_hook_source(variant)))
        passes.append((grid, plan))
    return dataclasses.replace(base, label=base.label[:-1] + f",{tag}>", passes=tuple(passes))


#: Whether the backward of a variant on compute capability 9.0 takes the Hopper backward
#: (attn_bwd_wgmma.cu: cuflash_bwd_wgmma_var) where `hopper_bwd_variant_reason` allows, under
#: kernel="auto" (before the mma.sync backward) and kernel="hopper" (which raises saying why
#: where it does not qualify; with the flag off kernel="hopper" raises for every variant). On
#: since session n (2026-12-04): its GPU tests (tests/test_hopper_bwd_variants_gpu.py) passed on
#: the H200 and benchmarks/bench_variants.py --backward 1 --impl base,hopperbwd measured softcap,
#: ALiBi and the window at 0.89-1.00 per visited tile of the plain Hopper backward (0.47-0.50 on
#: the mma.sync backward; benchmarks/RESULTS.md, session k). False restores the mma.sync backward.
HOPPER_BWD_VARIANTS = True


def hopper_bwd_variant_plan(dtype_name: str, d: int, causal: bool, deterministic: bool,
                            variant):
    """The Hopper backward with the variant's policy (attn_bwd_wgmma.cu: cuflash_bwd_wgmma_var):
    the plain Hopper backward plan (`_dispatch.bwd_hopper_plan`: its tiles, preprocess and dq
    conversion) with ``_var<..., V>`` in the kernel's name and the variant's parts in the
    labels. The policy has the Hopper forward's form (`policy_name` without ALIBI_AFFINE's, which
    only a forward computes), so that the backward recomputes the forward's logits."""
    import dataclasses

    from . import _dispatch

    base = _dispatch.bwd_hopper_plan(dtype_name, d, causal, deterministic)
    blocks = False if deterministic else "bwd"   # (the turn chains: HOOK_BLOCKS_BWD)
    pol, tag = policy_name(variant, blocks=blocks), policy_label(variant, blocks=blocks)
    passes = []
    for grid, plan in base.passes:
        if "cuflash_bwd_wgmma<" in plan.spec.name:
            name = plan.spec.name.replace("cuflash_bwd_wgmma<", "cuflash_bwd_wgmma_var<")
            name = name.replace("cuflash::PlainVariant", pol)
            smem = plan.smem_bytes + hopper_bwd_variant_smem(plan.threads, plan.block_m,
                                                             _dispatch.head_dim_bucket(
                                                                 d, _dispatch.HOPPER_BWD_CONFIGS),
                                                             variant)
            plan = dataclasses.replace(plan, label=plan.label[:-1] + f",{tag}>", smem_bytes=smem,
                                       spec=Specialisation(plan.spec.family, name,
                                                           arch=plan.spec.arch,
                                                           extra_source=_hook_source(variant)))
        passes.append((grid, plan))
    return dataclasses.replace(base, label=base.label[:-1] + f",{tag}>", passes=tuple(passes))


def hopper_bwd_variant_smem(threads: int, bm: int, dpad: int, variant) -> int:
    """Shared-memory bytes the Hopper backward adds to the plain kernel's for a policy with
    d score / d t (softcap, a score_mod) outside the D = 256 form (attn_bwd_wgmma.cu: DSC_SMEM):
    BM / 2 floats a thread, kept there from P^T to dS^T instead of in registers."""
    dscore = bool(variant.softcap) or getattr(variant, "score_mod", None) is not None
    return threads * bm * 2 if dscore and dpad <= 128 else 0


def _reads_tensors(variant) -> bool:
    """Whether the policy reads a tensor (variants.cuh: READS; ALiBi's slopes included)."""
    return (variant.alibi_slopes is not None or variant.bias is not None
            or variant.mask is not None)


def hopper_bwd_variant_reason(prob, compute_capability) -> "str | None":
    """Why the Hopper backward cannot run these inputs with their variant (None: it can): the
    plain Hopper backward's conditions (`_dispatch.bwd_hopper_reason`), bias / mask tensors read
    with a column stride of 0 or 1, and the policies whose registers fit beside dK and dV (the
    compile set, hopper_bwd_variant_compile_specs, has no spills under NVRTC 13.0 and 13.5):
    D = 128 the positional parts (window, softcap, ALiBi) in any combination, D = 256 every
    built-in part (without causal in deterministic mode only those that read no tensor: ALiBi
    and window + bias spilled 12-24 bytes there), user hooks with either (HOPPER_BWD_HOOKS),
    nothing at D <= 64 (BM = 128: the plain kernel's registers are at 252-255)."""
    from ._dispatch import HOPPER_BWD_CONFIGS, bwd_hopper_reason, head_dim_bucket
    why = bwd_hopper_reason(prob, compute_capability)
    if why is not None:
        return why
    var = prob.variant
    if getattr(var, "has_mods", False) and not HOPPER_BWD_HOOKS:
        return ("user hooks are not taken there (_dispatch_variants.HOPPER_BWD_HOOKS is off)")
    dpad = head_dim_bucket(prob.d, HOPPER_BWD_CONFIGS)
    if dpad < 128:
        return (f"with a variant it takes head dims from 65 (got {prob.d}: at D = {dpad} its "
                "registers are at the cap without a policy)")
    if dpad == 128 and (var.bias is not None or var.mask is not None):
        return ("at D = 128 it takes the positional parts only (window, softcap, ALiBi): a bias "
                "or mask tensor's per-element reads spill its registers")
    if (dpad == 256 and _reads_tensors(var) and not prob.causal
            and getattr(prob, "deterministic", False)):
        return ("at D = 256 without causal in deterministic mode it takes no policy that reads "
                "tensors (ALiBi, bias, mask): ALiBi and window + bias spilled its registers")
    return _column_stride_reason(var)


def hopper_bwd_variant_compile_specs():
    """The Hopper backward's variant specialisations the compile check builds (sm_90a): at D128
    the positional parts (window, softcap, ALiBi) alone and combined, with and without causal
    and deterministic (float16; bfloat16 the combination); at D256 the same parts and a bias (in
    float32 and float16), a mask and all five (float16; bfloat16 all five), as
    `hopper_bwd_variant_reason` admits them; and the forms tests/test_hopper_bwd_variants_gpu.py
    runs."""
    out = []

    def add(dt, d, causal, det, pol):
        for _, plan in hopper_bwd_variant_plan(dt, d, causal, det, pol).passes:
            if "_var<" in plan.spec.name and plan.spec not in out:
                out.append(plan.spec)

    positional = [_Spec(window=True), _Spec(softcap=True), _Spec(alibi=True),
                  _Spec(window=True, softcap=True, alibi=True)]
    reads = [_Spec(bias="float32"), _Spec(bias="float16"), _Spec(mask=True),
             _Spec(window=True, softcap=True, alibi=True, bias="float32", mask=True)]
    for causal in (False, True):
        for det in (False, True):
            for pol in positional:
                add("float16", 128, causal, det, pol)
            add("bfloat16", 128, causal, det, positional[-1])
            for pol in positional + reads:
                if _reads_tensors(pol) and det and not causal:
                    continue   # (hopper_bwd_variant_reason refuses it)
                add("float16", 256, causal, det, pol)
            if not (det and not causal):
                add("bfloat16", 256, causal, det, reads[-1])
    for pol in (_Spec(window=True, softcap=True), _Spec(softcap=True, alibi=True),
                _Spec(window=True, alibi=True)):
        add("float16", 128, True, False, pol)
    # user hooks (HOPPER_BWD_HOOKS): the example hooks' forms that compile without spills
    from .mods import example_hooks
    ex = example_hooks()
    for causal in (False, True):
        for det in (False, True):
            add("float16", 128, causal, det, _with_mods(_Spec(), None, ex["document"]))
            add("float16", 128, causal, det, _with_mods(_Spec(), ex["tanh_cap"], None))
            add("bfloat16", 256, causal, det, _with_mods(_Spec(), ex["rel_bias"], None))
        add("float16", 256, causal, False, _with_mods(_Spec(), ex["tanh_cap"], ex["prefix_lm"]))
    return out


def bwd_tensorcore_variant_reason(prob, compute_capability) -> "str | None":
    """Why the tensor-core backward cannot run these inputs with their variant (None: it can):
    the plain backward's conditions (`_dispatch.bwd_tensorcore_reason`: float16 / bfloat16,
    head dims up to max(TC_BWD_CONFIGS), alignment, ...) and bias / mask tensors read with a
    column stride of 0 or 1; user hooks up to D = TC_BWD_HOOK_MAX_D. Every built-in part and
    dbias are supported."""
    from ._dispatch import bwd_tensorcore_reason
    why = bwd_tensorcore_reason(prob, compute_capability)
    if why is not None:
        return why
    if getattr(prob.variant, "has_mods", False) and prob.d > TC_BWD_HOOK_MAX_D:
        return (f"with user hooks it takes head dims up to {TC_BWD_HOOK_MAX_D} (got {prob.d}): "
                "beside the dk and dv accumulators of larger ones a hook's registers spill")
    return _column_stride_reason(prob.variant)


def variant_backward_plan_for(prob, compute_capability=None):
    """The backward plan of a problem with a variant: the tensor-core backward for
    ``kernel="auto"`` / ``"tensorcore"`` where it qualifies, else the generic variant kernels
    (``"tensorcore"`` then raises ValueError naming the variant and the reason). Under
    HOPPER_BWD_VARIANTS the Hopper backward first where `hopper_bwd_variant_reason` allows
    (``"hopper"`` demands it and raises saying why not); with the flag off ``"hopper"`` raises."""
    if prob.kernel == "hopper" and not HOPPER_BWD_VARIANTS:
        raise ValueError(f"kernel='hopper' cannot run this backward: {_variant_words(prob.variant)}"
                         " is not supported there (_dispatch_variants.HOPPER_BWD_VARIANTS is off);"
                         " use kernel='auto', 'tensorcore' or 'generic'")
    if HOPPER_BWD_VARIANTS and prob.kernel in ("auto", "hopper"):
        why_not = hopper_bwd_variant_reason(prob, compute_capability)
        if why_not is None:
            return hopper_bwd_variant_plan(prob.dtype_name, prob.d, prob.causal,
                                           bool(getattr(prob, "deterministic", False)),
                                           prob.variant)
        if prob.kernel == "hopper":
            raise ValueError(f"kernel='hopper' cannot run this backward with "
                             f"{_variant_words(prob.variant)}: {why_not}; use kernel='auto', "
                             "'tensorcore' or 'generic'")
    if prob.kernel in ("auto", "tensorcore") and compute_capability is not None:
        why_not = bwd_tensorcore_variant_reason(prob, compute_capability)
        if why_not is None:
            return bwd_tensorcore_variant_plan(prob.dtype_name, prob.d, prob.causal,
                                               bool(getattr(prob, "deterministic", False)),
                                               compute_capability, prob.variant)
        if prob.kernel == "tensorcore":
            raise ValueError(f"kernel='tensorcore' cannot run this backward with "
                             f"{_variant_words(prob.variant)}: {why_not}")
    elif prob.kernel == "tensorcore":
        raise ValueError(f"kernel='tensorcore' cannot run this backward with "
                         f"{_variant_words(prob.variant)}: no GPU compute capability given")
    return bwd_generic_variant_plan(prob.dtype_name, prob.d, prob.dv, prob.causal,
                                    prob.variant)


def variant_backward_fallback_reason(prob, compute_capability) -> "str | None":
    """Why ``kernel="auto"`` runs the generic backward for a problem with a variant (None when
    it takes the tensor-core backward, or the kernel was chosen by name)."""
    if prob.kernel != "auto" or compute_capability is None:
        return None
    if HOPPER_BWD_VARIANTS and hopper_bwd_variant_reason(prob, compute_capability) is None:
        return None   # the Hopper backward runs it
    return bwd_tensorcore_variant_reason(prob, compute_capability)


def tensorcore_variant_backward_compile_specs(compute_capability: int = 90):
    """The tensor-core backward's variant specialisations the compile check builds (sm_90):
    for float16 and bfloat16 at D64 and D128, every part alone (bias in float32 and float16),
    window with and without causal, the five parts combined with and without causal and
    deterministic; the positional parts combined (no reads); and the user hooks of
    `mod_compile_specs` at D64 (TC_BWD_HOOK_MAX_D), also on every built-in part."""
    from .mods import example_hooks
    cc = compute_capability
    out = []

    def add(dt, d, causal, det, pol):
        for _, plan in bwd_tensorcore_variant_plan(dt, d, causal, det, cc, pol).passes:
            if "_var<" in plan.spec.name and plan.spec not in out:
                out.append(plan.spec)

    ex = example_hooks()
    cap, rel, doc = ex["tanh_cap"], ex["rel_bias"], ex["document"]
    for dt in ("float16", "bfloat16"):
        for d in (64, 128):
            for pol in (_Spec(softcap=True), _Spec(alibi=True), _Spec(bias="float32"),
                        _Spec(bias="float16"), _Spec(mask=True)):
                add(dt, d, False, False, pol)
            for causal in (False, True):
                add(dt, d, causal, False, _Spec(window=True))
                for det in (False, True):
                    add(dt, d, causal, det, _Spec(window=True, softcap=True, alibi=True,
                                                  bias="float32", mask=True))
            add(dt, d, True, True, _Spec(window=True))
            add(dt, d, True, False, _Spec(window=True, softcap=True, alibi=True))
        add(dt, 64, False, False, _with_mods(_Spec(), cap, None))
        add(dt, 64, True, False, _with_mods(_Spec(), rel, doc))
        add(dt, 64, True, True, _with_mods(_Spec(), rel, doc))
        add(dt, 64, True, False, _with_mods(_Spec(window=True, alibi=True), cap, doc))
    add("float16", 64, True, True, _with_mods(_Spec(window=True, softcap=True, alibi=True,
                                                    bias="float32", mask=True), cap, doc))
    return out


def form_compile_specs(compute_capability: int = 90):
    """The specialisations of the tensor-core kernels' non-default forms the compile check builds
    (sm_90 / sm_90a), built with their flags on whatever their values: softcap's FMA-pipe
    reciprocal (SOFTCAP_RCP_FMA, FORM 1) and with it the fused scale (VARIANT_FUSED_SCALE, FORM
    3) on softcap alone and on all five parts, and the fused scale alone (FORM 2) on softcap,
    ALiBi, window, bias and all five. The Hopper forward: float16 D64, D128 and D256 each part
    alone under causal, D128 the positional parts and all five with and without causal, bfloat16
    D128 all five; the mma.sync forward and backward: float16 and bfloat16 D64 and D128, each part
    alone and all five under causal (the backward's all five also deterministic; where
    `fused_form` keeps the backward's policy unfused, its spec is the default set's and not added
    here); ALIBI_AFFINE
    (FORM 4, with the fused scale 6) on the Hopper forward under causal: ALiBi alone and with a
    mask at float16 D64, D128, D256 and bfloat16 D128."""
    global SOFTCAP_RCP_FMA, VARIANT_FUSED_SCALE, ALIBI_AFFINE
    cc = compute_capability
    out = []
    sc, al = _Spec(softcap=True), _Spec(alibi=True)
    wi, bi = _Spec(window=True), _Spec(bias="float16")
    positional = _Spec(window=True, softcap=True, alibi=True)
    every = _Spec(window=True, softcap=True, alibi=True, bias="float32", mask=True)
    was = SOFTCAP_RCP_FMA, VARIANT_FUSED_SCALE, ALIBI_AFFINE

    def add(spec):
        if spec not in out:
            out.append(spec)

    try:
        for rcp, fused, parts in ((True, False, (sc, every)), (True, True, (sc, every)),
                                  (False, True, (sc, al, wi, bi, every))):
            SOFTCAP_RCP_FMA, VARIANT_FUSED_SCALE = rcp, fused
            for pol in parts:
                for d in (64, 128, 256):
                    add(hopper_variant_plan("float16", d, True, 1024, pol).spec)
            for causal in (False, True):
                add(hopper_variant_plan("float16", 128, causal, 1024, positional).spec)
                add(hopper_variant_plan("float16", 128, causal, 1024, every).spec)
            add(hopper_variant_plan("bfloat16", 128, True, 1024, every).spec)
            for dt in ("float16", "bfloat16"):
                for d in (64, 128):
                    for pol in parts:
                        add(tensorcore_variant_plan(dt, d, True, cc, pol).spec)
                    for pol, det in [(x, False) for x in parts] + [(every, True)]:
                        for _, plan in bwd_tensorcore_variant_plan(dt, d, True, det, cc,
                                                                   pol).passes:
                            # (a policy fused_form keeps unfused here: the default set's)
                            if "_var<" in plan.spec.name and _has_form(plan.spec):
                                add(plan.spec)
        # ALIBI_AFFINE (FORM 4, with the fused scale 6): the Hopper forward under causal, ALiBi
        # alone and with a mask; float16 D64 / D128 / D256, bfloat16 D128
        SOFTCAP_RCP_FMA, ALIBI_AFFINE = False, True
        for fused in (False, True):
            VARIANT_FUSED_SCALE = fused
            for pol in (al, _Spec(alibi=True, mask=True)):
                for dt, d in (("float16", 64), ("float16", 128), ("float16", 256),
                              ("bfloat16", 128)):
                    add(hopper_variant_plan(dt, d, True, 1024, pol).spec)
    finally:
        SOFTCAP_RCP_FMA, VARIANT_FUSED_SCALE, ALIBI_AFFINE = was
    return out


def hook_blocks_compile_specs(compute_capability: int = 90):
    """The forwards with HOOK_BLOCKS' narrowed tile walks (UserVariant's BLOCKS), built with the
    flag on whatever its value, for the example mask hooks as tests/test_mods_gpu.py's
    test_hook_blocks_forward runs them: the Hopper forward (float16 D64, D128, D256 and bfloat16
    D128, causal or not), the mma.sync forward (float16, bfloat16 D64, D128) and the generic
    forward (float16, float32 D64), each with the document mask_mod alone, the prefix-LM one
    alone, and the document one beside a score_mod, a window and ALiBi; and the backwards with
    HOOK_BLOCKS_BWD's (the Hopper backward at D = 64, 128 and 256, the mma.sync one at D = 64, the
    generic one, non-deterministic) for the same policies."""
    global HOOK_BLOCKS, HOOK_BLOCKS_BWD
    from .mods import example_hooks
    ex = example_hooks()
    doc, pre, cap = ex["document"], ex["prefix_lm"], ex["tanh_cap"]
    pols = (_with_mods(_Spec(), None, doc), _with_mods(_Spec(), None, pre),
            _with_mods(_Spec(window=True, alibi=True), cap, doc))
    was, HOOK_BLOCKS = HOOK_BLOCKS, True
    was_bwd, HOOK_BLOCKS_BWD = HOOK_BLOCKS_BWD, True
    out = []
    try:
        for pol in pols:
            for causal in (False, True):
                for dt, d in (("float16", 64), ("float16", 128), ("float16", 256),
                              ("bfloat16", 128)):
                    out.append(hopper_variant_plan(dt, d, causal, 1024, pol).spec)
                for dt in ("float16", "bfloat16"):
                    for d in (64, 128):
                        out.append(tensorcore_variant_plan(dt, d, causal, compute_capability,
                                                           pol).spec)
                for dt in ("float16", "float32"):
                    out.append(generic_variant_plan(dt, 64, 64, causal, pol).spec)
                bwds = [hopper_bwd_variant_plan("float16", d, causal, False, pol)
                        for d in (64, 128, 256)]
                bwds.append(bwd_tensorcore_variant_plan("float16", 64, causal, False,
                                                        compute_capability, pol))
                bwds.append(bwd_generic_variant_plan("float32", 64, 64, causal, pol))
                out += [pl.spec for b in bwds for _, pl in b.passes if "hook-blocks" in pl.label]
    finally:
        HOOK_BLOCKS, HOOK_BLOCKS_BWD = was, was_bwd
    return list(dict.fromkeys(out))


def _has_form(spec) -> bool:
    """Whether a tensor-core variant specialisation's policy has FORM bits (policy_name's sixth
    argument)."""
    return any(f", {b}>" in spec.name for b in range(1, 8))


def variant_backward_compile_specs():
    """The backward variant specialisations the compile check builds: softcap alone (its
    derivative) and the combination of all parts with and without causal, D64 and D128."""
    out = []
    for dt in ("float16", "bfloat16", "float32", "float64"):
        pols = _compile_policies(dt)
        for db, (pol, causal) in [(64, pols[1]), (64, pols[-2]), (64, pols[-1]),
                                  (128, pols[-1])]:
            for _, plan in bwd_generic_variant_plan(dt, db, db, causal, pol).passes:
                out.append(plan.spec)
    return out


def mod_compile_specs():
    """Forward and backward specialisations with user hooks (`cuflash.mods.example_hooks`) for
    the compile check (sm_90): a score_mod alone, score_mod + mask_mod, both with window and
    ALiBi (tests/test_mods_gpu.py's composed case), and both on top of all built-in parts at
    D128."""
    from .mods import example_hooks
    ex = example_hooks()
    cap, rel, doc = ex["tanh_cap"], ex["rel_bias"], ex["document"]
    out = []
    for dt in ("float16", "bfloat16", "float32", "float64"):
        pols = _compile_policies(dt)
        cases = [(_with_mods(_Spec(), cap, None), False, 64),
                 (_with_mods(_Spec(), rel, doc), True, 64),
                 (_with_mods(_Spec(window=True, alibi=True), cap, doc), True, 64),
                 (_with_mods(pols[-1][0], cap, doc), True, 128)]
        for pol, causal, db in cases:
            out.append(generic_variant_plan(dt, db, db, causal, pol).spec)
            for _, plan in bwd_generic_variant_plan(dt, db, db, causal, pol).passes:
                out.append(plan.spec)
    return out


def _with_mods(spec, score_mod, mask_mod):
    spec.score_mod, spec.mask_mod = score_mod, mask_mod
    spec.has_mods = True
    return spec


def _add_d64_forms(add, dt):
    """The D64 forms of a forward compile set, through add(dtype, d, causal, policy): every part
    alone (bias in float16 and float32), window and the five parts combined with and without
    causal, the positional parts (window, softcap, ALiBi) combined under causal."""
    every = _Spec(window=True, softcap=True, alibi=True, bias="float32", mask=True)
    for pol in (_Spec(softcap=True), _Spec(alibi=True), _Spec(bias="float32"),
                _Spec(bias="float16"), _Spec(mask=True)):
        add(dt, 64, False, pol)
    for causal in (False, True):
        add(dt, 64, causal, _Spec(window=True))
        add(dt, 64, causal, every)
    add(dt, 64, True, _Spec(window=True, softcap=True, alibi=True))


def tensorcore_variant_compile_specs(compute_capability: int = 90):
    """The tensor-core forward's variant specialisations the compile check builds (sm_90): at
    D64 every part alone (bias in float16 and float32), window and the five parts combined with
    and without causal, for float16, bfloat16 and float32 (3xTF32), the forms
    tests/test_variants_gpu.py runs; every part combined under causal at each larger head dim
    (float16), at D128 for bfloat16, float32 "highest" and, at D256, "high"; the positional
    parts alone combined (no reads: the plain tiles at D64); and the user hooks of
    `mod_compile_specs` on the tensor-core kernel."""
    from .mods import example_hooks
    cc = compute_capability
    out = []

    def add(dt, d, causal, pol, precision="highest"):
        spec = tensorcore_variant_plan(dt, d, causal, cc, pol, precision).spec
        if spec not in out:
            out.append(spec)

    for dt in ("float16", "bfloat16", "float32"):
        _add_d64_forms(add, dt)
    every16 = _Spec(window=True, softcap=True, alibi=True, bias="float32", mask=True)
    for d in (96, 128, 192, 256):
        add("float16", d, True, every16)
    add("float16", 128, True, _Spec(window=True, softcap=True, alibi=True))
    add("float16", 256, True, _Spec(window=True, softcap=True, alibi=True))
    add("float16", 64, False, _Spec(bias="float64"))
    add("bfloat16", 128, True, every16)
    add("float32", 128, True, every16)
    add("float32", 256, True, every16, "high")
    ex = example_hooks()
    cap, rel, doc = ex["tanh_cap"], ex["rel_bias"], ex["document"]
    for dt in ("float16", "bfloat16", "float32"):
        add(dt, 64, False, _with_mods(_Spec(), cap, None))
        add(dt, 64, True, _with_mods(_Spec(), rel, doc))
        add(dt, 64, True, _with_mods(_Spec(window=True, alibi=True), cap, doc))
    add("float16", 128, True, _with_mods(_Spec(window=True, softcap=True, alibi=True,
                                               bias="float32", mask=True), cap, doc))
    return out
