"""The tensor-core backward with a variant's policy (attn_bwd_mma.cu: cuflash_bwd_mma_var), without
a GPU: dispatch on a described device (kernel="auto" takes it for float16 / bfloat16 at the head
dims of TC_BWD_CONFIGS, the generic variant backward otherwise with the reason in
backward_fallback_reason; kernel="tensorcore" raises naming the variant), the compile set, and
the lane-level model (tests/bwd_mma_model.py) run on the parameters launch_backward builds for a
window (tile skipping, dense turns in deterministic mode) and softcap (its derivative), checked
against the float64 reference and against a brute-force count of the (key block, query tile)
pairs that hold a visible element."""
import types
from types import SimpleNamespace

import numpy as np
import pytest

from cuflash import _compile, _dispatch, _launch
from cuflash import reference as ref
from cuflash._dispatch_variants import (TC_BWD_HOOK_CONFIGS, TC_BWD_VARIANT_CONFIGS,
                                        tensorcore_variant_backward_compile_specs,
                                        variant_backward_fallback_reason,
                                        variant_backward_plan_for)
from cuflash.mods import example_hooks
from cuflash.variants import Variant

from seeds import SEED, case_rng
from test_tc_variants_cpu import _arr

ATTRS = {"max_smem_optin": 232448, "sm_count": 132, "compute_capability": 90}


@pytest.fixture(autouse=True)
def base_forms(monkeypatch):
    """These tests check the policies' structure in their base form (FORM 0): the forms behind
    _dispatch_variants' flags, on by default or not, are tests/test_variant_forms_cpu.py's. And
    the mma.sync backward's dispatch: on compute capability 9.0 the Hopper backward takes its
    variants first (HOPPER_BWD_VARIANTS, tests/test_hopper_bwd_variants_cpu.py), so it is off
    here."""
    from cuflash import _dispatch_variants
    for name in ("SOFTCAP_RCP_FMA", "VARIANT_FUSED_SCALE", "ALIBI_AFFINE",
                 "HOPPER_BWD_VARIANTS"):
        monkeypatch.setattr(_dispatch_variants, name, False)


def _prob(var, dtype="float16", d=64, kernel="auto", causal=False, det=False):
    q = _arr((2, 3, 100, d))
    return SimpleNamespace(kernel=kernel, variant=var, dtype_name=dtype, d=d, dv=d,
                           causal=causal, backend="gpu", scale=0.125, deterministic=det,
                           q=q, k=q, v=q, o=q, do=q, out_grads=None, sq=100, sk=120,
                           batch_shape=(2, 3), return_dbias=False)


@pytest.fixture
def aligned(monkeypatch):
    monkeypatch.setattr(_dispatch, "_aligned16", lambda x: True)


@pytest.mark.parametrize("cc", [80, 90])
@pytest.mark.parametrize("d", [64, 128])
def test_auto_takes_the_tensorcore_backward_for_a_variant(cc, d, aligned):
    prob = _prob(Variant(left=8, right=0, softcap=20.0), d=d, causal=True)
    bp = variant_backward_plan_for(prob, cc)
    kern = bp.passes[0][1]
    assert kern.spec.family == "attn_bwd_mma"
    assert kern.spec.name.startswith("cuflash::cuflash_bwd_mma_var<cuflash::fp16_t, ")
    assert kern.spec.name.endswith(", cuflash::Variant<true, true, false, cuflash::NoBias, "
                                   "false>>")
    assert bp.label.startswith(f"tensorcore-bwd<float16,D{d},") and \
        bp.label.endswith(",causal,window,softcap>"), bp.label
    assert variant_backward_fallback_reason(prob, cc) is None
    # the plain plan's tiles, preprocess and dq conversion
    plain = _dispatch.bwd_tensorcore_plan("float16", d, True, False, cc)
    assert (bp.block_m, bp.block_n, bp.dq_accum_row) == (plain.block_m, plain.block_n,
                                                         plain.dq_accum_row)
    assert bp.preprocess == plain.preprocess and bp.passes[1] == plain.passes[1]
    # the same template arguments up to OPT (TC_BWD_VARIANT_CONFIGS drops it at D = 128)
    targs = kern.spec.name.replace("_var<", "<").rsplit(", cuflash::Variant", 1)[0]
    assert targs.rsplit(", ", 1)[0] == plain.passes[0][1].spec.name.rsplit(", ", 1)[0]
    cfg = TC_BWD_VARIANT_CONFIGS.get((d, False))
    assert targs.endswith(f", {cfg[4] if cfg and len(cfg) > 4 else 0 if cfg else 1}"), targs


def test_fallbacks_say_why_and_tensorcore_raises_naming_the_variant(aligned):
    var = Variant(left=8, right=0)
    for dtype, d, why in (("float32", 64, "float16"), ("float16", 256, "head dims up to 128"),
                          ("float16", 60, "multiple of 8")):
        prob = _prob(var, dtype=dtype, d=d)
        bp = variant_backward_plan_for(prob, 90)
        assert bp.label.startswith(f"generic-bwd<{dtype},"), bp.label
        reason = variant_backward_fallback_reason(prob, 90)
        assert reason is not None and why in reason, reason
        with pytest.raises(ValueError, match=r"kernel='tensorcore' cannot run this backward "
                                             r"with the attention variant \(window\): "):
            variant_backward_plan_for(_prob(var, dtype=dtype, d=d, kernel="tensorcore"), 90)
    # a bias read with a column stride of 2 elements
    strided = _arr((100, 240), itemsize=4, strides=(960, 8))
    strided.dtype = np.dtype(np.float32)
    prob = _prob(Variant(bias=strided))
    assert variant_backward_plan_for(prob, 90).label.startswith("generic-bwd<")
    assert "column stride" in variant_backward_fallback_reason(prob, 90)
    with pytest.raises(ValueError, match=r"attention variant \(bias<float32>\): it reads bias"):
        variant_backward_plan_for(_prob(Variant(bias=strided), kernel="tensorcore"), 90)
    # generic by name: no reason; hopper: refused, naming the variant and its hooks
    assert variant_backward_fallback_reason(_prob(var, kernel="generic"), 90) is None
    ex = example_hooks()
    hooked = Variant(softcap=2.0, score_mod=ex["tanh_cap"], mod_batch=(2, 3))
    with pytest.raises(ValueError, match=r"kernel='hopper'.*attention variant \(softcap,"
                                         r"score_mod\[.*user hook score_mod"):
        variant_backward_plan_for(_prob(hooked, kernel="hopper"), 90)
    # deterministic with a broadcast q (the plain kernel's condition) falls back too
    prob = _prob(var, det=True)
    prob.q = _arr((1, 3, 100, 64))
    assert "deterministic" in variant_backward_fallback_reason(prob, 90)


def test_hooks_and_dbias_on_the_tensorcore_backward(aligned):
    ex = example_hooks()
    var = Variant(score_mod=ex["tanh_cap"], mask_mod=ex["document"], mod_batch=(2, 3))
    bp = variant_backward_plan_for(_prob(var, det=True), 90)
    kern = bp.passes[0][1]
    assert kern.spec.name.startswith("cuflash::cuflash_bwd_mma_var<")
    assert "cuflash::UserVariant<" in kern.spec.name and "struct Mod_" in kern.spec.extra_source
    assert "det," in bp.label and f"score_mod[{ex['tanh_cap'].digest[:8]}]" in bp.label
    kcfg = bp.passes[0][1]
    assert (kcfg.block_m, kcfg.block_n) == (TC_BWD_HOOK_CONFIGS[64][0],
                                            16 * TC_BWD_HOOK_CONFIGS[64][1])
    # at D = 128 hooks fall back (registers), saying so
    prob = _prob(var, d=128)
    assert variant_backward_plan_for(prob, 90).label.startswith("generic-bwd<float16,D128,")
    assert "user hooks" in variant_backward_fallback_reason(prob, 90)
    bias = _arr((1, 120), itemsize=4)
    bias.dtype = np.dtype(np.float32)
    prob = _prob(Variant(bias=bias))
    prob.return_dbias = True
    assert variant_backward_plan_for(prob, 90).label.endswith(",bias<float32>>")


def test_backward_compile_set():
    names = [s.name for s in tensorcore_variant_backward_compile_specs(90)]
    assert len(names) == len(set(names)) and names
    assert all(n.startswith("cuflash::cuflash_bwd_mma_var<") for n in names)
    for dt in ("cuflash::fp16_t", "cuflash::bf16_t"):
        assert any(n.startswith(f"cuflash::cuflash_bwd_mma_var<{dt}, 64, ") and
                   "UserVariant" in n for n in names)
        assert any(n.startswith(f"cuflash::cuflash_bwd_mma_var<{dt}, 128, ") for n in names)
    from cuflash import precompile
    assert set(tensorcore_variant_backward_compile_specs(90)) <= set(
        precompile.specialisations(90))


# ---- the lane-level model with a window and softcap ------------------------------------------

MODEL_CASES = [  # (dtype, q batch, kv batch, Sq, Sk, D, causal, det, window, softcap)
    ("float16", (2,), (2,), 150, 200, 64, False, True, (20, 5), 0.0),    # skips both ways
    ("float16", (1,), (1,), 70, 300, 64, True, True, (40, -1), 0.0),     # causal ∩ window
    ("bfloat16", (1, 2), (1, 1), 200, 70, 64, False, True, (0, 0), 3.0),  # MQA, diagonal only
    ("float16", (1,), (1,), 150, 150, 128, True, True, (10, 3), 2.0),    # BN = 128
    ("float16", (2,), (2,), 200, 100, 40, False, False, (-1, 7), 0.0),   # right only, D padded
    ("bfloat16", (1,), (1,), 90, 90, 64, True, False, (-1, -1), 1.5),    # softcap alone
]


def _record(bp, prob, grads, mem, monkeypatch):
    """launch_backward's launches (name, grid, threads, every kernel argument)."""
    acc = 4
    ws_bytes = _launch.backward_workspace_bytes(bp, prob)
    ws = types.SimpleNamespace(nbytes=ws_bytes, data=types.SimpleNamespace(
        ptr=mem.alloc(ws_bytes // acc, acc)))
    launches = []

    def get_kernel(spec, dev, smem=0):
        return lambda grid, block, args, shared_mem=0, stream=None: launches.append(
            (spec.name, grid[0], block[0], tuple(args)))

    monkeypatch.setattr(_compile, "get_kernel", get_kernel)
    monkeypatch.setattr(_launch, "_stream_ptr", lambda s: None)
    _launch.launch_backward(bp, prob, *grads, ws, ATTRS)
    return launches


def _expected_visits(var, causal, sq, sk, bm, bn, n_red, n_owners):
    """(block, query tile, reduction step) that hold a pair (i, j) visible by position for the
    window and, separately, one visible under the causal mask (the kernel intersects the two
    tile relations), counted by brute force over elements."""
    i = np.arange(sq)[:, None]
    j = np.arange(sk)[None, :]
    off = sk - sq
    win = np.ones((sq, sk), bool)
    if var.left >= 0:
        win &= j >= i + off - var.left
    if var.right_eff(causal) >= 0:
        win &= j <= i + off + var.right_eff(causal)
    cau = (j <= i + off) if causal else np.ones((sq, sk), bool)
    nn, nm = -(-sk // bn), -(-sq // bm)
    out = set()
    for owner in range(n_owners):
        for nblock in range(nn):
            bid = owner * nn + (nn - 1 - nblock)
            for m in range(nm):
                rows, keys = slice(m * bm, (m + 1) * bm), slice(nblock * bn, (nblock + 1) * bn)
                if win[rows, keys].any() and cau[rows, keys].any():
                    out.update((bid, m, red) for red in range(n_red))
    return out


@pytest.mark.parametrize("dtype,qb,kb,sq,sk,d,causal,det,window,cap", MODEL_CASES)
def test_tensorcore_backward_model_with_a_variant(dtype, qb, kb, sq, sk, d, causal, det, window,
                                                  cap, monkeypatch):
    import bwd_generic_model as gmodel
    import bwd_mma_model as model

    rng = case_rng(SEED, "mma-var-model", dtype, qb, kb, sq, sk, d, causal, det, window, cap)
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
                                 kernel="tensorcore", backend="gpu", out_grads=None,
                                 variant=var, return_dbias=False)
    monkeypatch.setattr(_dispatch, "_aligned16", lambda x: True)  # FakeArrays: no real pointers
    bp = _dispatch.backward_plan_for(prob, 90)
    assert bp.label.startswith("tensorcore-bwd") and bp.deterministic == det, bp.label
    launches = _record(bp, prob, grads, mem, monkeypatch)
    visits = []
    model.run_plan_launches(mem, launches, bp, causal, visits=visits)

    # every (key block, query tile) that holds a visible pair is visited, and no other
    kern = [x for x in launches if "bwd_mma_var" in x[0]][0]
    n_red = int(np.prod(batch)) // int(np.prod(kb))
    bm, bn = bp.passes[0][1].block_m, bp.block_n
    expect = _expected_visits(var, causal, sq, sk, bm, bn, n_red, kern[1] // (-(-sk // bn)))
    assert len(visits) == len(set(visits)) and set(visits) == expect
    nn, nm = -(-sk // bn), -(-sq // bm)
    if window != (-1, -1):   # the window skips tiles in these cases
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


def test_model_catches_a_wrong_window_reach(monkeypatch):
    """The checks are sharp: a row_range that reaches one query tile too far (visits a tile
    without a visible pair), or one that stops a tile short (skips visible pairs), fails."""
    import bwd_mma_model as model

    real = model._window_ranges
    for shift in (64, -64):
        def wrong(vp, sq, sk, shift=shift):
            key_range, row_range, visible = real(vp, sq, sk)

            def reach(j0, j1):
                r0, r1 = row_range(j0, j1)
                return r0, max(r0, min(sq, r1 + shift))
            return key_range, reach, visible

        monkeypatch.setattr(model, "_window_ranges", wrong)
        with pytest.raises(AssertionError):
            test_tensorcore_backward_model_with_a_variant(*MODEL_CASES[0], monkeypatch)


@pytest.mark.parametrize("fused", [False, True])
def test_refusal_names_the_variant_not_a_form(fused, monkeypatch):
    """kernel="tensorcore" refusing a float32 variant backward names the variant's parts, not
    the form a tensor-core kernel would have compiled (VARIANT_FUSED_SCALE on added
    ",fused-scale" to the message, seen on the H200 2026-12-02)."""
    from cuflash import _dispatch_variants
    monkeypatch.setattr(_dispatch_variants, "VARIANT_FUSED_SCALE", fused)
    prob = _prob(Variant(left=8, right=0), dtype="float32", kernel="tensorcore")
    with pytest.raises(ValueError, match=r"with the attention variant \(window\): "):
        variant_backward_plan_for(prob, 90)
    # the plan a float16 input gets still names the form in its label
    label = variant_backward_plan_for(_prob(Variant(left=8, right=0)), 90).label
    assert label.endswith(",window,fused-scale>" if fused else ",window>"), label
