"""Host side of the variant launches without a GPU: VariantParams mirrors the struct in
kernels_cu/variants.cuh field by field, the batch collapse takes the variant's tensors into
account, and the kernel gets VariantParams as its second argument. Arrays are stand-ins."""
import re
from pathlib import Path

import numpy as np

from cuflash import _compile, _launch
from cuflash._dispatch_variants import generic_variant_plan
from cuflash._launch_variants import VARIANT_PARAMS_DTYPE
from cuflash.variants import Variant

from test_launch import ATTRS, FakeArray, _problem, launches  # noqa: F401  (fixture)


def test_variant_params_mirror_the_struct():
    src = (Path(_compile.SOURCE_DIR) / "variants.cuh").read_text()
    body = re.search(r"struct VariantParams \{(.*?)\};", src, re.S).group(1)
    body = re.sub(r"//[^\n]*", "", body)
    names = []
    for decl in filter(None, (x.strip() for x in body.split(";"))):
        parts = [x.strip() for x in decl.split(",")]
        names.append(parts[0].split()[-1].lstrip("*"))
        names += [x.lstrip("*") for x in parts[1:]]
    assert names == list(VARIANT_PARAMS_DTYPE.names)
    assert VARIANT_PARAMS_DTYPE.itemsize == 35 * 8


def _launch_args(q, k, v, o, batch, sq, sk, d, var, causal):
    """(plan, the kernel's arguments) of a forward launch of `var` on stand-in arrays."""
    prob = _problem(q, k, v, batch, sq, sk, d)
    prob.variant, prob.causal = var, causal
    got = {}

    def kernel(grid, block, args, shared_mem=0, stream=None):
        got["args"] = args

    comp_get = _compile.get_kernel
    try:
        _compile.get_kernel = lambda spec, dev, smem: kernel
        plan = generic_variant_plan("float16", d, d, causal, var)
        _launch.launch_forward(plan, prob, o, None, ATTRS)
    finally:
        _compile.get_kernel = comp_get
    return plan, got["args"]


def test_forward_launch_passes_variant_params(launches):  # noqa: F811
    b, h, sq, sk, d = 2, 3, 100, 120, 64
    q = FakeArray((b, h, sq, d), (h * sq * d, sq * d, d, 1), 0x1000)
    k = FakeArray((b, h, sk, d), (h * sk * d, sk * d, d, 1), 0x2000)
    v = FakeArray((b, h, sk, d), (h * sk * d, sk * d, d, 1), 0x3000)
    o = FakeArray((b, h, sq, d), (h * sq * d, sq * d, d, 1), 0x4000)
    bias = FakeArray((h, 1, sk), (sk, 0, 1), 0x5000, itemsize=4)    # per head, shared rows
    bias.dtype = np.dtype(np.float32)
    mask = FakeArray((sq, sk), (sk, 1), 0x6000, itemsize=1)
    mask.dtype = np.dtype(bool)
    var = Variant(left=16, right=-1, softcap=30.0, bias=bias, mask=mask)
    plan, (params, vp) = _launch_args(q, k, v, o, (b, h), sq, sk, d, var, True)
    assert vp.dtype == VARIANT_PARAMS_DTYPE
    assert (int(vp["left"]), int(vp["right"])) == (16, 0)      # causal: right = 0
    assert float(vp["softcap"]) == 30.0 and float(vp["inv_softcap"]) == 1 / 30.0
    assert int(vp["bias"]) == 0x5000 and int(vp["mask"]) == 0x6000
    # (b, h) collapse to one axis of 6 (q, k, v, o contiguous; bias and mask broadcast)
    assert [int(params[f"nb{i}"]) for i in range(3)] == [1, 2, 3]
    assert [int(vp[f"bias_s{i}"]) for i in range(3)] == [0, 0, sk]
    assert (int(vp["bias_sr"]), int(vp["bias_sc"])) == (0, 1)
    assert [int(vp[f"mask_s{i}"]) for i in range(3)] == [0, 0, 0]
    assert (int(vp["mask_sr"]), int(vp["mask_sc"])) == (sk, 1)
    assert int(vp["dscores"]) == 0
    assert "cuflash_fwd_generic_var<cuflash::fp16_t, float, 64, 64, true, " \
           "cuflash::Variant<true, true, false, float, true>>" in plan.spec.name
    assert plan.label.startswith("generic<float16,D64,causal,window,softcap,bias<float32>,mask>")


def test_launch_passes_the_hook_parameters(launches):  # noqa: F811
    """User hooks (cuflash/mods.py): the args pointer, the head count and the strides that turn
    the collapsed batch coordinates back into the flat batch index."""
    from cuflash.mods import example_hooks

    b, h, sq, sk, d = 2, 3, 100, 120, 64
    q = FakeArray((b, h, sq, d), (h * sq * d, sq * d, d, 1), 0x1000)
    k = FakeArray((b, h, sk, d), (h * sk * d, sk * d, d, 1), 0x2000)
    v = FakeArray((b, h, sk, d), (h * sk * d, sk * d, d, 1), 0x3000)
    o = FakeArray((b, h, sq, d), (h * sq * d, sq * d, d, 1), 0x4000)
    args = FakeArray((7,), (1,), 0x7000, itemsize=4)
    mask = FakeArray((h, sq, sk), (sq * sk, sk, 1), 0x6000, itemsize=1)   # per head: no merge
    mask.dtype = np.dtype(bool)
    for m, nb, mod_s in ((None, [1, 1, 6], [0, 0, 1]), (mask, [1, 2, 3], [0, 3, 1])):
        var = Variant(mask=m, score_mod=example_hooks()["rel_bias"], mod_args=args,
                      mod_batch=(b, h))
        _, (params, vp) = _launch_args(q, k, v, o, (b, h), sq, sk, d, var, False)
        assert [int(params[f"nb{i}"]) for i in range(3)] == nb
        assert int(vp["mod_args"]) == 0x7000 and int(vp["mod_h"]) == h
        assert [int(vp[f"mod_s{i}"]) for i in range(3)] == mod_s


def test_launch_passes_a_mask_mods_ranges(launches, monkeypatch):  # noqa: F811
    """_dispatch_variants.HOOK_BLOCKS: a forward plan with a mask_mod takes UserVariant's BLOCKS
    (named in the kernel and the label) and its launch makes the hook's summary and ranges on the
    call's stream and passes them (entry strides in ints: 0 on an axis the hook's code does not
    name); flag off, none is made and the pointer is null. The backward's policies never narrow."""
    from cuflash import _dispatch_variants as DV
    from cuflash import _mask_blocks
    from cuflash.mods import MaskMod

    b, h, sq, sk, d = 2, 3, 100, 120, 64
    q = FakeArray((b, h, sq, d), (h * sq * d, sq * d, d, 1), 0x1000)
    k = FakeArray((b, h, sk, d), (h * sk * d, sk * d, d, 1), 0x2000)
    v = FakeArray((b, h, sk, d), (h * sk * d, sk * d, d, 1), 0x3000)
    o = FakeArray((b, h, sq, d), (h * sq * d, sq * d, d, 1), 0x4000)
    per_head = MaskMod("kv_idx <= q_idx + 8 * h", numpy=lambda b, h, qi, kj, a: kj <= qi + 8 * h)
    made = []

    def contiguous(shape, ptr, itemsize):
        return FakeArray(shape, tuple(int(np.prod(shape[i + 1:])) for i in range(len(shape))),
                         ptr, itemsize)

    def fake_summary(mm, batch, sq_, sk_, dev, args=None, stream=None):
        made.append((batch, sq_, sk_))
        return contiguous(_mask_blocks.hook_summary_shape(mm, batch, sq_, sk_), 0x8000, 1)

    def fake_ranges(summary, sq_, sk_, dev, stream=None):
        rb, cb = summary.shape[-2:]
        return contiguous(tuple(summary.shape[:-2]) + (_mask_blocks.RANGE_INTS * rb + 2 * cb,),
                          0x9000, 4)

    monkeypatch.setattr(_mask_blocks, "hook_summary", fake_summary)
    monkeypatch.setattr(_mask_blocks, "hook_ranges", fake_ranges)
    var = Variant(mask_mod=per_head, mod_batch=(b, h))
    for flag in (False, True):
        monkeypatch.setattr(DV, "HOOK_BLOCKS", flag)
        made.clear()
        plan, (params, vp) = _launch_args(q, k, v, o, (b, h), sq, sk, d, var, False)
        assert ("hook-blocks" in plan.label) == flag, plan.label
        assert plan.spec.name.endswith(", false, true, true>>" if flag else ", false, true>>")
        if not flag:
            assert not made and int(vp["mod_ranges"]) == 0
            continue
        assert made == [((b, h), sq, sk)]
        rb = -(-sq // 64)
        assert int(vp["mod_ranges"]) == 0x9000
        cb = -(-sk // 64)
        assert (int(vp["mr_eb"]), int(vp["mr_eh"])) == (0, 4 * rb + 2 * cb)   # names h, not b
        for _, p in DV.bwd_generic_variant_plan("float16", d, d, False, var).passes:
            assert "hook-blocks" not in p.label and p.spec.name.endswith(", false, true>>")
    # HOOK_BLOCKS_BWD: the backwards without deterministic turns take BLOCKS too (the generic
    # one has none: always); the deterministic mma.sync and Hopper ones keep the full walk
    monkeypatch.setattr(DV, "HOOK_BLOCKS", True)
    monkeypatch.setattr(DV, "HOOK_BLOCKS_BWD", True)
    for det in (False, True):
        plans = [DV.bwd_generic_variant_plan("float16", d, d, False, var),
                 DV.bwd_tensorcore_variant_plan("float16", d, False, det, 90, var),
                 DV.hopper_bwd_variant_plan("float16", 128, False, det, var)]
        for i, bp in enumerate(plans):
            narrowed = [p for _, p in bp.passes if "hook-blocks" in p.label]
            assert bool(narrowed) == (i == 0 or not det), (det, bp.label)
            assert all(p.spec.name.endswith(", false, true, true>>") for p in narrowed)
            assert ("hook-blocks" in bp.label) == bool(narrowed), bp.label


def test_hook_blocks_hopper_tiles(monkeypatch):
    """A mask_mod alone on the 16-bit Hopper forward keeps the read-nothing tiles (128 keys) at
    D = 64 with HOOK_BLOCKS; at D = 128 the narrowed walk takes 64 keys (128 spilled 68-72 B
    under causal), as before the flag where it is off."""
    from cuflash import _dispatch_variants as DV
    from cuflash.mods import example_hooks
    var = Variant(mask_mod=example_hooks()["prefix_lm"], mod_batch=(2, 3))
    for flag, bn128, bn64 in ((False, "BN128", "BN128"), (True, "BN64", "BN128")):
        monkeypatch.setattr(DV, "HOOK_BLOCKS", flag)
        for d, bn in ((128, bn128), (64, bn64)):
            label = DV.hopper_variant_plan("float16", d, True, 1024, var).label
            assert f",{bn}," in label and ("hook-blocks" in label) == flag, label
