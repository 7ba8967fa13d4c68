"""Dispatch and launch of the attention variants on the Hopper forward (attn_wgmma.cu:
cuflash_fwd_wgmma_var), without a GPU: problems are stand-ins on a described device (compute
capability 9.0, the tensor-map API patched in). kernel="hopper" takes the Hopper kernel for a
variant it supports, naming the parts in the label; kernel="auto" takes it only with
_dispatch_variants.HOPPER_VARIANTS_AUTO; user hooks and strided bias / mask are refused with the
reason; the launch passes VariantParams as the kernel's second argument after HopperParams."""
import numpy as np
import pytest

from cuflash import _compile, _dispatch, _dispatch_variants, _launch, _launch_variants, _tma
from cuflash._dispatch_variants import (hopper_variant_compile_specs, hopper_variant_plan,
                                        variant_plan_for)
from cuflash.mods import example_hooks
from cuflash.variants import Variant, variant_of

from test_launch import ATTRS, FakeArray, _problem, launches  # noqa: F401  (fixture)
from test_tc_variants_cpu import _arr, _prob


@pytest.fixture(autouse=True)
def base_forms(monkeypatch):
    """These tests check the policies' structure in their base form (FORM 0): the forms behind
    _dispatch_variants' flags, on by default or not, are tests/test_variant_forms_cpu.py's."""
    from cuflash import _dispatch_variants
    for name in ("SOFTCAP_RCP_FMA", "VARIANT_FUSED_SCALE", "ALIBI_AFFINE"):
        monkeypatch.setattr(_dispatch_variants, name, False)


@pytest.fixture
def tma(monkeypatch):
    monkeypatch.setattr(_tma, "available", lambda: True)


def test_hopper_takes_a_variant_by_name(tma):
    plan = variant_plan_for(_prob(Variant(softcap=30.0, left=64, right=0), kernel="hopper",
                                  causal=True), 90)
    assert plan.spec.family == "attn_wgmma" and plan.spec.arch == "sm_90a"
    plain = _dispatch.hopper_plan("float16", 64, True, 120, sq=100)
    assert plan.spec.name.startswith("cuflash::cuflash_fwd_wgmma_var<cuflash::fp16_t, 1, 64, ")
    assert plan.spec.name.endswith(", true, cuflash::Variant<true, true, false, "
                                   "cuflash::NoBias, false>>"), plan.spec.name
    assert plan.label.startswith("hopper<float16,D64,BM128,") and \
        plan.label.endswith(",causal,window,softcap>"), plan.label
    # the plain plan's kernel and launch shape, two consumers (HOPPER_VARIANT_TILES)
    assert plan.threads == 384 and plan.block_m == 128 and plain.persistent == plan.persistent


def test_auto_takes_hopper_only_with_the_flag(tma, monkeypatch):
    prob = _prob(Variant(left=8, right=0))
    monkeypatch.setattr(_dispatch_variants, "HOPPER_VARIANTS_AUTO", False)
    assert variant_plan_for(prob, 90).spec.family == "attn_mma"
    monkeypatch.setattr(_dispatch_variants, "HOPPER_VARIANTS_AUTO", True)
    assert variant_plan_for(prob, 90).spec.family == "attn_wgmma"
    assert variant_plan_for(prob, 80).spec.family == "attn_mma"   # sm_80: never Hopper
    # what the Hopper kernel cannot take still goes to the mma.sync kernel under auto
    assert variant_plan_for(_prob(Variant(softcap=2.0), d=32), 90).spec.family == "attn_mma"
    # float32 follows _dispatch.HOPPER_F32_AUTO as the plain path does
    f32 = _prob(Variant(softcap=2.0), dtype="float32")
    f32.q = f32.k = f32.v = _arr((2, 3, 100, 64), itemsize=4)
    assert variant_plan_for(f32, 90).label.startswith("hopper<float32,3xfp16,")
    monkeypatch.setattr(_dispatch, "HOPPER_F32_AUTO", False)
    assert variant_plan_for(f32, 90).spec.family == "attn_mma"


def test_hooks_on_the_hopper_kernel(tma):
    ex = example_hooks()
    var = Variant(score_mod=ex["tanh_cap"], mask_mod=ex["document"], mod_batch=(2, 3))
    plan = variant_plan_for(_prob(var, kernel="hopper", causal=True), 90)
    assert plan.spec.name.startswith("cuflash::cuflash_fwd_wgmma_var<cuflash::fp16_t, 1, 64, 64,")
    assert "cuflash::UserVariant<" in plan.spec.name and "struct Mod_" in plan.spec.extra_source
    assert f"score_mod[{ex['tanh_cap'].digest[:8]}]" in plan.label
    # D128 (HOPPER_HOOK_WIDE): 64-key tiles without bias or mask tensors, 32 with (the old
    # HOPPER_HOOK_TILES), 128 for a mask_mod alone; float32 keeps HOPPER_HOOK_TILES
    assert hopper_variant_plan("float16", 128, True, 1024, var).block_n == 64
    masked = Variant(score_mod=ex["tanh_cap"], mask=np.ones((100, 120), bool), mod_batch=(2, 3))
    assert hopper_variant_plan("float16", 128, True, 1024, masked).block_n == 32
    alone = Variant(mask_mod=ex["prefix_lm"], mod_batch=(2, 3))
    assert hopper_variant_plan("bfloat16", 128, False, 1024, alone).block_n == 128
    assert hopper_variant_plan("float16", 64, True, 1024, alone).block_n == 128
    assert hopper_variant_plan("float32", 128, True, 1024, var).block_n == 32
    positional = Variant(mask_mod=ex["prefix_lm"], left=10, right=0, mod_batch=(2, 3))
    assert hopper_variant_plan("float16", 128, True, 1024, positional).block_n == 64


def test_hook_tiles_follow_their_flag(tma, monkeypatch):
    ex = example_hooks()
    var = Variant(score_mod=ex["tanh_cap"], mod_batch=(2, 3))
    alone = Variant(mask_mod=ex["prefix_lm"], mod_batch=(2, 3))
    monkeypatch.setattr(_dispatch_variants, "HOPPER_HOOK_WIDE", False)
    assert hopper_variant_plan("float16", 128, True, 1024, var).block_n == 32
    assert hopper_variant_plan("float16", 128, True, 1024, alone).block_n == 32
    assert hopper_variant_plan("float16", 64, True, 1024, alone).block_n == 64


def test_hopper_refusals_say_why(tma):
    strided = _arr((100, 240), itemsize=4, strides=(960, 8))
    strided.dtype = np.dtype(np.float32)
    with pytest.raises(ValueError, match="kernel='hopper'.*column stride"):
        variant_plan_for(_prob(Variant(bias=strided), kernel="hopper"), 90)
    with pytest.raises(ValueError, match="kernel='hopper'.*compute capability 9.0 only"):
        variant_plan_for(_prob(Variant(softcap=2.0), kernel="hopper"), 80)
    with pytest.raises(ValueError, match="kernel='hopper'.*head dims from 64"):
        variant_plan_for(_prob(Variant(softcap=2.0), kernel="hopper", d=32), 90)


def test_variant_tiles_and_forms():
    """HOPPER_VARIANT_TILES: the tile overrides where registers need them; float32's forms keep
    their operand type last in the name (3xfp16: cuflash::fp16_t after the policy)."""
    reads = Variant(bias=np.zeros((1, 120), np.float32))
    d64 = hopper_variant_plan("float16", 64, False, 1024, reads)
    assert (d64.block_m, d64.block_n) == (128, 64)
    d256 = hopper_variant_plan("float16", 256, True, 1024, Variant(softcap=3.0))
    assert d256.block_n == 64 and "overlap" not in d256.label
    assert ", 256, 64, 2, 1, 2, false, true, true, cuflash::Variant<" in d256.spec.name
    long_keys = hopper_variant_plan("float16", 128, False, 8192, Variant(left=4096, right=-1))
    assert long_keys.block_n == 128 and not long_keys.persistent
    f16s = hopper_variant_plan("float32", 64, True, 1024, Variant(softcap=3.0))
    assert f16s.spec.name.endswith("cuflash::NoBias, false>, cuflash::fp16_t>"), f16s.spec.name
    assert f16s.label.startswith("hopper<float32,3xfp16,D64,")
    tf32 = hopper_variant_plan("float32", 64, True, 1024, reads, "high")
    assert tf32.spec.name.startswith("cuflash::cuflash_fwd_wgmma_var<float, 1, 64, 64, ")
    assert tf32.spec.name.endswith("cuflash::Variant<false, false, false, float, false>>")
    for plan in (d64, d256, long_keys, f16s, tf32):
        assert plan.smem_bytes <= ATTRS["max_smem_optin"]


def test_compile_set_holds_the_test_forms():
    names = [s.name for s in hopper_variant_compile_specs()]
    assert len(names) == len(set(names)) and all("cuflash_fwd_wgmma_var<" in n for n in names)
    for dt in ("cuflash::fp16_t", "cuflash::bf16_t", "float"):
        assert any(n.startswith(f"cuflash::cuflash_fwd_wgmma_var<{dt}, ") for n in names)
    # every form tests/test_variants_gpu.py runs on kernel="hopper" at D64 is in the set
    from test_variants_gpu import HOPPER_CASES, _host_variant
    rng = np.random.default_rng(0)
    for name, causal, dtype in HOPPER_CASES:
        var = variant_of(_host_variant(name, rng, 113, 1000, dtype))
        assert hopper_variant_plan(dtype, 64, causal, 1000, var).spec.name in names, name


def test_launch_passes_variant_params(launches, monkeypatch):  # noqa: F811
    """HopperParams (tensor maps made) first, VariantParams second, the plan's launch shape."""
    b, h, sq, sk, d = 2, 3, 100, 120, 64
    shapes = {"q": (sq, 0x1000), "k": (sk, 0x2000), "v": (sk, 0x3000), "o": (sq, 0x4000)}
    arrays = {n: FakeArray((b, h, rows, d), (h * rows * d, rows * d, d, 1), ptr)
              for n, (rows, ptr) in shapes.items()}
    prob = _problem(arrays["q"], arrays["k"], arrays["v"], (b, h), sq, sk, d)
    prob.variant, prob.causal = Variant(left=16, right=-1, softcap=30.0), False
    calls = []
    monkeypatch.setattr(_compile, "get_kernel",
                        lambda spec, dev, smem: lambda *a, **kw: calls.append((spec, a, kw)))
    plan = hopper_variant_plan("float16", d, False, sk, prob.variant, sq=sq)
    _launch.launch_forward(plan, prob, arrays["o"], None, ATTRS)
    (spec, (grid, block, (params, vp)), kw), = calls
    assert spec == plan.spec and block == (plan.threads,) and kw["shared_mem"] == plan.smem_bytes
    assert params.dtype == _launch.HOPPER_PARAMS_DTYPE and len(launches["maps"]) == 3
    assert vp.dtype == _launch_variants.VARIANT_PARAMS_DTYPE
    assert int(vp["left"]) == 16 and int(vp["right"]) == -1 and float(vp["softcap"]) == 30.0
    assert int(params["n_mblocks"]) == -(-sq // plan.block_m)
