"""The launch side of attention variants: `VariantParams` (kernels_cu/variants.cuh) mirrored as a
NumPy structured dtype, and the batch-axis collapse with the variant's tensors (bias, mask, ALiBi
slopes) taken into account, so that every tensor of the launch shares the same <= 3 collapsed
batch axes. Passed to the kernels as a second argument after AttnParams / BwdParams (whose
layouts do not change)."""
from __future__ import annotations

import numpy as np

from ._launch import collapse_batch

_VP_PTRS = ("bias", "mask", "slopes")
_VP_INTS1 = ("left", "right")
_VP_DBL = ("softcap", "inv_softcap")
_VP_INTS2 = tuple(f"{t}_{s}" for t in ("bias", "mask") for s in ("s0", "s1", "s2", "sr", "sc")) \
    + ("sl_s0", "sl_s1", "sl_s2", "dscores")
_VP_MODS = ("mod_args", "mod_h", "mod_s0", "mod_s1", "mod_s2")   # user hooks (UserVariant)
_VP_BLOCKS = ("mask_blocks", "mb_s0", "mb_s1", "mb_s2", "mb_sr", "mb_cmax")   # the mask's summary
_VP_RANGES = ("mod_ranges", "mr_eb", "mr_eh")   # a mask_mod's key ranges (UserVariant, BLOCKS)
VARIANT_PARAMS_DTYPE = np.dtype([(f, np.uint64) for f in _VP_PTRS]
                                + [(f, np.int64) for f in _VP_INTS1]
                                + [(f, np.float64) for f in _VP_DBL]
                                + [(f, np.int64) for f in _VP_INTS2]
                                + [(f, np.int64) for f in _VP_MODS]
                                + [(f, np.int64) for f in _VP_BLOCKS]
                                + [(f, np.int64) for f in _VP_RANGES])
assert VARIANT_PARAMS_DTYPE.itemsize == 35 * 8  # static_assert in kernels_cu/variants.cuh


class _FlatIndex:
    """The flat batch index n as a (batch..., 1, 1) "tensor" for collapse_batch: its collapsed
    batch strides are the multipliers that turn the collapsed coordinates back into n (the user
    hooks' b = n // H, h = n % H)."""

    def __init__(self, batch):
        batch = tuple(int(n) for n in batch)
        self.shape = batch + (1, 1)
        st, acc = [], 1
        for n in reversed(self.shape):
            st.append(acc)
            acc *= n
        self.strides = tuple(reversed(st))
        self.itemsize, self.ndim = 1, len(self.shape)


def with_mask_blocks(variant, families, device_id, stream):
    """`variant` with its mask's block summary (`_mask_blocks`) for kernels of ``families``
    (names): the caller's (a `cuflash.BlockMask`), else one made now on ``stream`` when one of
    them reads it (the tensor-core kernels); the variant unchanged otherwise."""
    import dataclasses

    from . import _mask_blocks
    if not _mask_blocks.ENABLED:   # (tests, bench --impl noblocks) no summary at all
        return variant if variant.mask_blocks is None else \
            dataclasses.replace(variant, mask_blocks=None)
    if variant.mask is None or variant.mask_blocks is not None \
            or not set(families) & set(_mask_blocks.READERS):
        return variant
    blocks = _mask_blocks.summarise(variant.mask, device_id, stream)
    return dataclasses.replace(variant, mask_blocks=blocks)


def with_hook_ranges(variant, plans, prob):
    """`variant` with its mask_mod's ranges (`_mask_blocks.hook_summary`, then `hook_ranges`:
    three launches and two small arrays from CuPy's pool, on the call's stream) when the policy
    of one of `plans` (the forward's plan, or a backward's passes) narrows its tiles by them
    (`_dispatch_variants.reads_hook_ranges`); the variant unchanged otherwise."""
    import dataclasses

    from . import _mask_blocks
    from ._dispatch_variants import reads_hook_ranges
    if variant.mask_mod is None or variant.hook_ranges is not None \
            or not any(reads_hook_ranges(p) for p in plans):
        return variant
    summary = _mask_blocks.hook_summary(variant.mask_mod, variant.mod_batch, prob.sq, prob.sk,
                                        prob.device_id, variant.mod_args, prob.stream)
    ranges = _mask_blocks.hook_ranges(summary, prob.sq, prob.sk, prob.device_id, prob.stream)
    return dataclasses.replace(variant, hook_ranges=ranges)


def variant_tensors(variant):
    """The variant's tensors, each with (..., rows, cols) axes, in the order fill_params reads
    their collapsed strides: bias, mask, the mask's summary, slopes (as (..., 1, 1)), those
    present."""
    out = []
    if variant.bias is not None:
        out.append(variant.bias)
    if variant.mask is not None:
        out.append(variant.mask)
        if variant.mask_blocks is not None:
            out.append(variant.mask_blocks)
    if variant.alibi_slopes is not None:
        out.append(variant.alibi_slopes[..., None, None])
    if variant.has_mods:
        out.append(_FlatIndex(variant.mod_batch))
    return out


def fill_params(prob, extra_bstr, dscores=None, variant=None):
    """VariantParams (a NumPy scalar) for ``variant`` (default `prob.variant`), with the
    collapsed batch strides of its tensors (``extra_bstr``, padded to three, in
    `variant_tensors` order)."""
    var = prob.variant if variant is None else variant
    vp = np.zeros((), dtype=VARIANT_PARAMS_DTYPE)
    vp["left"] = var.left if var.has_window else -1
    vp["right"] = var.right_eff(prob.causal) if var.has_window else -1
    if var.softcap:
        vp["softcap"], vp["inv_softcap"] = var.softcap, 1.0 / var.softcap
    names = [n for n, x in (("bias", var.bias), ("mask", var.mask),
                            ("mb", var.mask_blocks if var.mask is not None else None),
                            ("sl", var.alibi_slopes))
             if x is not None]
    if var.has_mods:
        names.append("mod")
        vp["mod_h"] = var.mod_batch[-1] if var.mod_batch else 1
        vp["mod_args"] = var.mod_args.data.ptr if var.mod_args is not None else 0
    for name, x, bs in zip(names, variant_tensors(var), extra_bstr):
        vp[f"{name}_s0"], vp[f"{name}_s1"], vp[f"{name}_s2"] = bs
        if name in ("bias", "mask"):
            vp[name] = x.data.ptr
            vp[f"{name}_sr"] = 0 if x.shape[-2] == 1 else x.strides[-2] // x.itemsize
            vp[f"{name}_sc"] = 0 if x.shape[-1] == 1 else x.strides[-1] // x.itemsize
        elif name == "mb":   # (mask batch..., RB, CB) contiguous; the row stride 0 where the
            vp["mask_blocks"] = x.data.ptr   # mask broadcasts rows, the last column CB - 1
            vp["mb_sr"] = 0 if var.mask.shape[-2] == 1 else x.shape[-1]
            vp["mb_cmax"] = x.shape[-1] - 1
        elif name == "sl":
            vp["slopes"] = x.data.ptr
    if var.hook_ranges is not None:   # (nb, nh, 4 RB + 2 CB) int32 contiguous: entry strides
        nb, nh, per = var.hook_ranges.shape   # in ints (_mask_blocks.numpy_hook_record)
        vp["mod_ranges"] = var.hook_ranges.data.ptr
        vp["mr_eb"] = nh * per if nb > 1 else 0
        vp["mr_eh"] = per if nh > 1 else 0
    vp["dscores"] = 0 if dscores is None else dscores.data.ptr
    return vp[()]


def pad3(sizes, bstr):
    """Pad collapsed batch axes to three (leading size-1 axes, stride 0), in place."""
    while len(sizes) < 3:
        sizes.insert(0, 1)
        for st in bstr:
            st.insert(0, 0)


TOO_MANY_AXES = ("the batch axes of the inputs and of bias / mask / alibi_slopes do not collapse "
                 "to three axes (more than three batch axes with unmergeable strides); pass "
                 "C-contiguous arrays")


def collapse_with_variant(prob, *tensors, variant=None):
    """`collapse_batch` over ``tensors`` (q, k, v, o as the forward passes them) and the
    tensors of ``variant`` (default `prob.variant`); returns (sizes padded to 3, bstr, rstr of
    ``tensors``, VariantParams as a NumPy scalar). Raises ValueError when the batch axes do not
    collapse to three."""
    variant = prob.variant if variant is None else variant
    extra = variant_tensors(variant)
    sizes, bstr, rstr = collapse_batch(prob.batch_shape, *tensors, *extra)
    if len(sizes) > 3:
        raise ValueError(TOO_MANY_AXES)
    pad3(sizes, bstr)
    n = len(tensors)
    return sizes, bstr[:n], rstr[:n], fill_params(prob, bstr[n:], variant=variant)


def is_variant_kernel(plan) -> bool:
    """Whether a plan's kernel takes VariantParams as its second argument."""
    return "_var<" in plan.spec.name
