"""The Hopper backward with a variant's policy (attn_bwd_wgmma.cu: cuflash_bwd_wgmma_var), without
a GPU: dispatch on a described device under _dispatch_variants.HOPPER_BWD_VARIANTS (on by
default since session n; off: the mma.sync backward as before, kernel="hopper" raises; on:
kernel="auto" takes it on compute capability
9.0 where hopper_bwd_variant_reason allows, before the mma.sync backward, and kernel="hopper"
demands it and raises saying why), its plan (the plain Hopper plan's tiles, preprocess and dq
conversion, the policy in the kernel's name and label, the shared memory of d score / d t) and
its compile set. The kernel's numerics are tests/test_hopper_bwd_variants_gpu.py's."""
from types import SimpleNamespace

import numpy as np
import pytest

from cuflash import _dispatch, _dispatch_variants
from cuflash._dispatch_variants import (hopper_bwd_variant_compile_specs,
                                        hopper_bwd_variant_plan, hopper_bwd_variant_reason,
                                        variant_backward_fallback_reason,
                                        variant_backward_plan_for)
from cuflash.mods import example_hooks
from cuflash.variants import Variant

from test_tc_variants_cpu import _arr


def _prob(var, dtype="float16", d=128, kernel="auto", causal=True, det=False):
    q = _arr((2, 3, 100, d))
    return SimpleNamespace(kernel=kernel, variant=var, dtype_name=dtype, d=d, dv=d,
                           causal=causal, backend="gpu", scale=0.125, deterministic=det,
                           q=q, k=q, v=q, o=q, do=q, out_grads=None, sq=100, sk=120,
                           batch_shape=(2, 3), return_dbias=False)


def _bias(dtype=np.float32):
    b = _arr((1, 120), itemsize=np.dtype(dtype).itemsize)
    b.dtype = np.dtype(dtype)
    return b


@pytest.fixture(autouse=True)
def aligned(monkeypatch):
    monkeypatch.setattr(_dispatch, "_aligned16", lambda x: True)


@pytest.fixture
def flag_on(monkeypatch):
    monkeypatch.setattr(_dispatch_variants, "HOPPER_BWD_VARIANTS", True)


@pytest.fixture
def flag_off(monkeypatch):
    monkeypatch.setattr(_dispatch_variants, "HOPPER_BWD_VARIANTS", False)


def test_flag_is_on_by_default():
    assert _dispatch_variants.HOPPER_BWD_VARIANTS is True


@pytest.mark.parametrize("var", [Variant(softcap=30.0), Variant(left=4096, right=0),
                                 Variant(left=64, right=0, softcap=30.0)])
def test_flag_off_keeps_the_mma_sync_backward(var, flag_off):
    prob = _prob(var)
    bp = variant_backward_plan_for(prob, 90)
    assert bp.label.startswith("tensorcore-bwd<float16,D128,"), bp.label
    assert bp.passes[0][1].spec.name.startswith("cuflash::cuflash_bwd_mma_var<")
    assert variant_backward_fallback_reason(prob, 90) is None
    with pytest.raises(ValueError, match=r"kernel='hopper' cannot run this backward: the "
                                         r"attention variant .*HOPPER_BWD_VARIANTS is off"):
        variant_backward_plan_for(_prob(var, kernel="hopper"), 90)


@pytest.mark.parametrize("det", [False, True])
@pytest.mark.parametrize("kernel", ["auto", "hopper"])
def test_flag_on_takes_the_hopper_backward(kernel, det, flag_on):
    var = Variant(softcap=30.0)
    prob = _prob(var, kernel=kernel, det=det)
    bp = variant_backward_plan_for(prob, 90)
    kern = bp.passes[0][1]
    plain = _dispatch.bwd_hopper_plan("float16", 128, True, det)
    pk = plain.passes[0][1]
    assert kern.spec.family == "attn_bwd_wgmma" and kern.spec.arch == "sm_90a"
    # the plain template arguments with the policy in place of PlainVariant (the fused form of
    # VARIANT_FUSED_SCALE, as the Hopper forward's)
    pol = _dispatch_variants.policy_name(var)
    assert kern.spec.name == pk.spec.name.replace("cuflash_bwd_wgmma<", "cuflash_bwd_wgmma_var<") \
        .replace("cuflash::PlainVariant", pol)
    tag = _dispatch_variants.policy_label(var)
    assert bp.label == plain.label[:-1] + f",{tag}>"
    assert bp.label.startswith("hopper-bwd<float16,D128,BM64,BN128,") and "softcap" in bp.label
    assert ("det," in bp.label) == det
    # softcap's d score / d t in shared memory: BM / 2 floats per thread
    assert kern.smem_bytes == pk.smem_bytes + pk.threads * pk.block_m * 2
    assert kern.smem_bytes <= 232448
    assert (bp.block_m, bp.block_n, bp.dq_accum_row, bp.deterministic) == (
        plain.block_m, plain.block_n, plain.dq_accum_row, plain.deterministic)
    assert bp.preprocess == plain.preprocess and bp.passes[1] == plain.passes[1]
    if kernel == "auto":
        assert variant_backward_fallback_reason(prob, 90) is None


@pytest.mark.parametrize("var,d,causal", [
    (Variant(left=4096, right=0), 128, True), (Variant(alibi_slopes=np.ones(3, np.float32)), 128,
                                               False),
    (Variant(left=16, right=16, softcap=5.0, alibi_slopes=np.ones(3, np.float32)), 128, False),
    (Variant(bias=_bias(), mask=_arr((100, 120), itemsize=1)), 256, True)])
def test_admitted_policies_and_their_smem(var, d, causal, flag_on):
    prob = _prob(var, d=d, causal=causal)
    assert hopper_bwd_variant_reason(prob, 90) is None
    bp = variant_backward_plan_for(prob, 90)
    kern, plain = bp.passes[0][1], _dispatch.bwd_hopper_plan("float16", d, causal, False)
    assert kern.spec.name.startswith("cuflash::cuflash_bwd_wgmma_var<cuflash::fp16_t, ")
    # no d score / d t (or the D = 256 form, which keeps it in registers): the plain smem
    pk = plain.passes[0][1]
    extra = pk.threads * pk.block_m * 2 if var.softcap and d <= 128 else 0
    assert kern.smem_bytes == pk.smem_bytes + extra


@pytest.mark.parametrize("var,d,causal,det,why", [
    (Variant(softcap=30.0), 64, True, False, "head dims from 65"),
    (Variant(bias=_bias()), 128, True, False, "positional parts only"),
    (Variant(mask=_arr((100, 120), itemsize=1)), 128, False, False, "positional parts only"),
    (Variant(alibi_slopes=np.ones(3, np.float32)), 256, False, True, "reads tensors"),
    (Variant(left=8, right=8, bias=_bias()), 256, False, True, "reads tensors"),
])
def test_refused_policies_fall_back_or_raise(var, d, causal, det, why, flag_on):
    prob = _prob(var, d=d, causal=causal, det=det)
    reason = hopper_bwd_variant_reason(prob, 90)
    assert reason is not None and why in reason, reason
    bp = variant_backward_plan_for(prob, 90)   # auto: the mma.sync backward, or generic
    assert not bp.label.startswith("hopper-bwd<"), bp.label
    if d <= 128:
        assert bp.label.startswith(f"tensorcore-bwd<float16,D{d},"), bp.label
    with pytest.raises(ValueError, match=r"kernel='hopper' cannot run this backward with the "
                                         r"attention variant \(.*\): .*" + why):
        variant_backward_plan_for(_prob(var, d=d, causal=causal, det=det, kernel="hopper"), 90)


def test_other_devices_hooks_and_dtypes_are_refused(flag_on):
    var = Variant(softcap=30.0)
    for cc in (80, 89):
        prob = _prob(var)
        assert variant_backward_plan_for(prob, cc).label.startswith("tensorcore-bwd<")
        with pytest.raises(ValueError, match="compute capability 9.0"):
            variant_backward_plan_for(_prob(var, kernel="hopper"), cc)
    prob = _prob(var, dtype="float32")
    assert "float16" in hopper_bwd_variant_reason(prob, 90)
    ex = example_hooks()
    hooked = Variant(score_mod=ex["tanh_cap"], mod_batch=(2, 3))
    prob = _prob(hooked, d=64)   # D <= 64: no policy there, hooks neither
    assert "head dims from 65" in hopper_bwd_variant_reason(prob, 90)
    assert variant_backward_plan_for(prob, 90).label.startswith("tensorcore-bwd<float16,D64,")
    with pytest.raises(ValueError, match=r"kernel='hopper'.*user hook score_mod: with a variant"):
        variant_backward_plan_for(_prob(hooked, d=64, kernel="hopper"), 90)


@pytest.mark.parametrize("d", [128, 256])
@pytest.mark.parametrize("hooks", ["score_mod", "mask_mod", "both"])
def test_hooks_take_the_hopper_backward_from_d65(flag_on, d, hooks, monkeypatch):
    """HOPPER_BWD_HOOKS: a hook at D = 65..256 takes the Hopper backward under auto (it went to
    the generic scalar kernel: ~100x slower, session r), named in the label by its hash; the
    flag off sends it back there and kernel="hopper" then says why; a hook with a mask tensor at
    D = 128 stays refused by the tensor rule."""
    ex = example_hooks()
    kw = dict(score_mod=ex["tanh_cap"] if hooks != "mask_mod" else None,
              mask_mod=ex["prefix_lm"] if hooks != "score_mod" else None)
    var = Variant(**kw, mod_batch=(2, 3))
    prob = _prob(var, d=d)
    assert hopper_bwd_variant_reason(prob, 90) is None
    label = variant_backward_plan_for(prob, 90).label
    assert label.startswith(f"hopper-bwd<float16,D{d},") and "_mod[" in label, label
    spec = hopper_bwd_variant_plan("float16", d, True, False, var).passes[0][1].spec
    assert "UserVariant" in spec.name and "cuflash_user" in spec.extra_source
    masked = Variant(**kw, mask=np.ones((100, 120), bool), mod_batch=(2, 3))
    if d == 128:
        assert "positional parts only" in hopper_bwd_variant_reason(_prob(masked, d=d), 90)
    monkeypatch.setattr(_dispatch_variants, "HOPPER_BWD_HOOKS", False)
    assert "HOPPER_BWD_HOOKS" in hopper_bwd_variant_reason(prob, 90)
    assert not variant_backward_plan_for(prob, 90).label.startswith("hopper-bwd<")
    with pytest.raises(ValueError, match=r"kernel='hopper'.*HOPPER_BWD_HOOKS is off"):
        variant_backward_plan_for(_prob(var, d=d, kernel="hopper"), 90)


def test_compile_set_holds_clean_hook_forms():
    names = [s.name for s in hopper_bwd_variant_compile_specs()]
    hooked = [n for n in names if "UserVariant" in n]
    assert len(hooked) == 14, hooked
    assert any(", 128, " in n for n in hooked) and any(", 256, " in n for n in hooked)


def test_compile_set_holds_the_benchmarked_forms():
    names = [s.name for s in hopper_bwd_variant_compile_specs()]
    assert names and len(names) == len(set(names))
    assert all(n.startswith("cuflash::cuflash_bwd_wgmma_var<") for n in names)
    assert all(s.arch == "sm_90a" for s in hopper_bwd_variant_compile_specs())
    # bench_variants.py's A/B at D = 128, causal, float16: softcap, ALiBi, window
    for var in (Variant(softcap=30.0), Variant(alibi_slopes=np.ones(3, np.float32)),
                Variant(left=4096, right=0)):
        spec = hopper_bwd_variant_plan("float16", 128, True, False, var).passes[0][1].spec
        assert spec.name in names, spec.name
    from cuflash import precompile
    specs = precompile.specialisations(90)
    assert all(s in specs for s in hopper_bwd_variant_compile_specs())
    assert not any("bwd_wgmma_var" in s.name for s in precompile.specialisations(80))


# ---- the thread-level model (tests/bwd_wgmma_model.py) with a window and softcap -------------

MODEL_CASES = [  # (dtype, q batch, kv batch, Sq, Sk, causal, det, window, softcap)
    ("float16", (2,), (2,), 150, 300, False, True, (20, 5), 0.0),     # skips both ways
    ("float16", (1,), (1,), 70, 300, True, True, (40, -1), 0.0),      # causal ∩ window
    ("bfloat16", (2, 1), (1, 1), 200, 70, False, True, (0, 0), 3.0),  # broadcast kv, diagonal
    ("float16", (1,), (1,), 150, 150, True, False, (10, 3), 2.0),     # window + softcap
    ("float16", (1,), (1,), 90, 200, False, False, (-1, -1), 1.5),    # softcap alone
    ("float16", (1,), (1,), 400, 400, False, False, (30, 30), 0.0),   # a band: tiles both sides
]


@pytest.mark.parametrize("dtype,qb,kb,sq,sk,causal,det,window,cap", MODEL_CASES)
def test_hopper_backward_model_with_a_variant(dtype, qb, kb, sq, sk, causal, det, window, cap,
                                              monkeypatch, flag_on):
    """launch_backward's launches for the Hopper variant plan (D = 128), run by the model: the
    (key block, query tile) pairs visited are exactly those that hold a visible pair, the
    deterministic turns are ready when each block gets there (the model asserts it), every
    gradient element is written and dq, dk, dv match the float64 reference."""
    import types

    import bwd_generic_model as gmodel
    import bwd_wgmma_model as model
    from cuflash import reference as ref
    from seeds import SEED, case_rng
    from test_tc_bwd_variants_cpu import _expected_visits, _record

    d = 128
    rng = case_rng(SEED, "wgmma-var-model", dtype, qb, kb, sq, sk, causal, det, window, cap)
    batch = tuple(np.broadcast_shapes(qb, kb))
    q = ref.round_to(rng.standard_normal(qb + (sq, d)) * 1.5, dtype)
    k = ref.round_to(rng.standard_normal(kb + (sk, d)), dtype)
    v = ref.round_to(rng.standard_normal(kb + (sk, d)), dtype)
    do = ref.round_to(rng.standard_normal(batch + (sq, d)), dtype)
    kw = dict(window=window if window != (-1, -1) else None, softcap=cap or None)
    o_ref, lse_ref = ref.attention_ref(q, k, v, causal=causal, **kw)
    o, lse = ref.round_to(o_ref, dtype), ref.round_to(lse_ref, "float32")
    mem = gmodel.Memory()
    fq, fk, fv, fo, fdo = (gmodel.FakeArray(mem, x, 2) for x in (q, k, v, o, do))
    flse = gmodel.FakeArray(mem, lse, 4)
    grads = [gmodel.FakeArray(mem, np.zeros(x.shape), 2) for x in (q, k, v)]
    for g in grads:  # poison: unwritten elements stay NaN
        g.mem.write(g.data.ptr, np.arange(g.nbytes // 2), np.full(g.nbytes // 2, np.nan))
    var = Variant(left=window[0], right=window[1], softcap=float(cap))
    prob = types.SimpleNamespace(q=fq, k=fk, v=fv, o=fo, do=fdo, lse=flse, batch_shape=batch,
                                 sq=sq, sk=sk, d=d, dv=d, dtype_name=dtype, scale=d ** -0.5,
                                 stream=None, device_id=0, deterministic=det, causal=causal,
                                 kernel="hopper", backend="gpu", out_grads=None,
                                 variant=var, return_dbias=False)
    bp = _dispatch.backward_plan_for(prob, 90)
    assert bp.label.startswith("hopper-bwd<") and bp.deterministic == det, bp.label
    launches = _record(bp, prob, grads, mem, monkeypatch)
    visits = []
    model.run_plan_launches(mem, launches, bp, causal, visits=visits)

    kern = [x for x in launches if "bwd_wgmma_var" in x[0]][0]
    n_red = int(np.prod(batch)) // int(np.prod(kb))
    bm, bn = bp.passes[0][1].block_m, bp.block_n
    nn, nm = -(-sk // bn), -(-sq // bm)
    # (block indices in the plain order, owner * nn + rank: the deterministic order groups them)
    plain_bid = {bid: o * nn + r for bid in range(kern[1])
                 for o, r in [model.block_order(bid, kern[1], nn, det, 132)]}
    visits = [(plain_bid[b], mt, red) for b, mt, red in visits]
    expect = _expected_visits(var, causal, sq, sk, bm, bn, n_red, kern[1] // nn)
    assert len(visits) == len(set(visits)) and set(visits) == expect
    if window not in ((-1, -1),) and sq >= 2 * bm:   # the window skips tiles in these cases
        assert len(visits) < kern[1] // nn * nn * nm * n_red

    g_ref = ref.attention_backward_ref(do, q, k, v, causal=causal, **kw)
    u = ref.unit_roundoff(dtype)
    fin = np.isfinite(lse_ref)
    lse_rel = 8 * 2.0 ** -24 * max(1.0, float(np.max(np.abs(lse_ref[fin])))) if fin.any() else 0
    for name, g, r in zip(("dq", "dk", "dv"), grads, g_ref):
        got = g.values()
        assert not np.isnan(got).any(), f"{name}: {int(np.isnan(got).sum())} elements unwritten"
        tol = (2 * u + lse_rel + 64 * 2.0 ** -53) * max(float(np.max(np.abs(r))), 1.0) * 8
        err = float(np.max(np.abs(got - r)))
        assert err <= tol, f"{name}: model error {err:.3e} > {tol:.3e}"
