"""Dispatch of the attention variants to the mma.sync tensor-core forward (attn_mma.cu:
cuflash_fwd_mma_var), without a GPU: problems are stand-ins on a described device. kernel="auto"
takes the tensor-core kernel for a variant where it qualifies (on sm_90 too, unless
_dispatch_variants.HOPPER_VARIANTS_AUTO: tests/test_hopper_variants_cpu.py), kernel="tensorcore"
demands it with a ValueError saying why, the label names the variant's parts, and the launch passes VariantParams as the kernel's second argument."""
from types import SimpleNamespace

import numpy as np
import pytest

from cuflash import _compile, _dispatch, _launch
from cuflash._dispatch_variants import (TC_VARIANT_CONFIGS, tensorcore_variant_compile_specs,
                                        tensorcore_variant_plan, variant_plan_for)
from cuflash.mods import example_hooks
from cuflash.variants import Variant

from test_launch import ATTRS, FakeArray, _problem, launches  # noqa: F401  (fixture)


@pytest.fixture(autouse=True)
def base_forms(monkeypatch):
    """These tests check the policies' structure in their base form (FORM 0): the forms behind
    _dispatch_variants' flags, on by default or not, are tests/test_variant_forms_cpu.py's."""
    from cuflash import _dispatch_variants
    for name in ("SOFTCAP_RCP_FMA", "VARIANT_FUSED_SCALE", "ALIBI_AFFINE"):
        monkeypatch.setattr(_dispatch_variants, name, False)


def _arr(shape, itemsize=2, ptr=0x1000, strides=None):
    if strides is None:
        st, acc = [], itemsize
        for n in reversed(shape):
            st.append(acc)
            acc *= n
        strides = tuple(reversed(st))
    return SimpleNamespace(shape=shape, strides=strides, itemsize=itemsize,
                           data=SimpleNamespace(ptr=ptr))


def _prob(var, dtype="float16", d=64, kernel="auto", causal=False):
    q = _arr((2, 3, 100, d))
    return SimpleNamespace(kernel=kernel, variant=var, dtype_name=dtype, d=d, dv=d,
                           causal=causal, backend="gpu", precision="highest", scale=0.125,
                           q=q, k=q, v=q, out=None, sq=100, sk=120)


@pytest.mark.parametrize("cc", [80, 90])
def test_auto_takes_the_tensorcore_kernel_for_a_variant(cc):
    plan = variant_plan_for(_prob(Variant(left=8, right=0), causal=True), cc)
    assert plan.spec.family == "attn_mma"
    assert plan.spec.name.startswith("cuflash::cuflash_fwd_mma_var<cuflash::fp16_t, 1, 64, 64, ")
    assert plan.spec.name.endswith(", true, cuflash::Variant<true, false, false, "
                                   "cuflash::NoBias, false>>")
    assert plan.label.startswith("tensorcore<float16,D64,") and \
        plan.label.endswith(",causal,window>")


def test_variant_plan_keeps_the_plain_tiles_where_they_fit():
    plain = _dispatch.tensorcore_plan("float16", 64, False, 90)
    var = tensorcore_variant_plan("float16", 64, False, 90, Variant(softcap=30.0))
    assert (var.block_m, var.block_n, var.threads, var.smem_bytes) == \
        (plain.block_m, plain.block_n, plain.threads, plain.smem_bytes)
    assert var.spec.name.replace("_var<", "<").rsplit(", cuflash::Variant", 1)[0] + ">" == \
        plain.spec.name
    # a bias: two blocks per SM (registers), the same tiles
    bias = tensorcore_variant_plan("float16", 64, False, 90,
                                   Variant(bias=np.zeros((1, 120), np.float32)))
    assert ", 2, true, false, cuflash::Variant<false, false, false, float, false>>" in \
        bias.spec.name
    big = tensorcore_variant_plan("float16", 128, True, 90, Variant(softcap=30.0))
    bn, nw, mt, _, _ = TC_VARIANT_CONFIGS[(128, False)]
    assert (big.block_m, big.block_n) == (16 * mt * nw, bn)
    assert big.smem_bytes == (big.block_m + 2 * bn) * (128 + 8) * 2


def test_tensorcore_refusals_say_why():
    with pytest.raises(ValueError, match="kernel='tensorcore' cannot run these inputs with the "
                                         r"attention variant \(window\): it takes float16"):
        variant_plan_for(_prob(Variant(left=8, right=0), dtype="float64", kernel="tensorcore"),
                         90)
    plan = variant_plan_for(_prob(Variant(left=8, right=0), dtype="float64"), 90)
    assert plan.label.startswith("generic<float64,D64,full,window>") and \
        "tensor-core kernel cannot run them: it takes float16" in plan.label
    # a bias read with a column stride of 2 elements: not on the tensor cores
    strided = _arr((100, 240), itemsize=4, strides=(960, 8))
    strided.dtype = np.dtype(np.float32)
    var = Variant(bias=strided)
    plan = variant_plan_for(_prob(var), 90)
    assert plan.label.startswith("generic<") and "column stride" in plan.label
    with pytest.raises(ValueError, match="kernel='hopper'.*attention variant.*head dims"):
        variant_plan_for(_prob(Variant(softcap=2.0), kernel="hopper", d=32), 90)


def test_hooks_on_the_tensorcore_kernel():
    ex = example_hooks()
    var = Variant(score_mod=ex["tanh_cap"], mask_mod=ex["document"], mod_batch=(2, 3))
    plan = variant_plan_for(_prob(var), 90)
    assert plan.spec.name.startswith("cuflash::cuflash_fwd_mma_var<")
    assert "cuflash::UserVariant<" in plan.spec.name and "struct Mod_" in plan.spec.extra_source
    assert f"score_mod[{ex['tanh_cap'].digest[:8]}]" in plan.label


def test_compile_set_holds_every_test_form():
    names = [s.name for s in tensorcore_variant_compile_specs(90)]
    assert len(names) == len(set(names))
    assert all("cuflash_fwd_mma_var<" in n for n in names)
    for dt in ("cuflash::fp16_t", "cuflash::bf16_t", "float"):
        assert any(n.startswith(f"cuflash::cuflash_fwd_mma_var<{dt}, ") and "UserVariant" in n
                   for n in names)


def test_forward_launch_passes_variant_params_to_the_tensorcore_kernel(launches):  # noqa: F811
    b, h, sq, sk, d = 2, 3, 100, 120, 64
    q, k, v, o = (FakeArray((b, h, n, d), (h * n * d, n * d, d, 1), ptr)
                  for n, ptr in ((sq, 0x1000), (sk, 0x2000), (sk, 0x3000), (sq, 0x4000)))
    prob = _problem(q, k, v, (b, h), sq, sk, d)
    prob.variant, prob.causal = Variant(left=16, right=-1, softcap=30.0), False
    got = {}

    def kernel(grid, block, args, shared_mem=0, stream=None):
        got.update(grid=grid, block=block, args=args, smem=shared_mem)

    comp_get = _compile.get_kernel
    try:
        _compile.get_kernel = lambda spec, dev, smem: kernel
        plan = tensorcore_variant_plan("float16", d, False, 90, prob.variant)
        _launch.launch_forward(plan, prob, o, None, ATTRS)
    finally:
        _compile.get_kernel = comp_get
    params, vp = got["args"]
    assert got["grid"] == (-(-sq // plan.block_m) * b * h,) and got["smem"] == plan.smem_bytes
    assert int(vp["left"]) == 16 and int(vp["right"]) == -1 and float(vp["softcap"]) == 30.0
    assert int(params["n_mblocks"]) == -(-sq // plan.block_m)
