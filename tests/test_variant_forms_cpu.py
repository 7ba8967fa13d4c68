"""CPU models of the tensor-core kernels' variant forms behind flags, against float64 over the
whole input range, and their dispatch (names, labels, the compile set): softcap's fast form with
the reciprocal on the FMA pipe (kernels_cu/variants.cuh: rcp_fma, softcap_fast_r<1>;
_dispatch_variants.SOFTCAP_RCP_FMA) and the fused scale (score_x, fused_score;
VARIANT_FUSED_SCALE): ALiBi's causal form, the bias's and softcap's fused products.

The model runs the kernel's instruction sequence in float32 (each fmaf as one rounding of the
exact float64 product-sum, the integer first guess on the bits). ex2.approx cannot be modelled
bit for bit; it enters as 2^z rounded to float32 and perturbed by its documented bound (2 ulp,
common.cuh: fast_exp2) both ways. What the error rule needs (cuflash.reference.error_bound,
notes/ERROR_BOUND.md): the exponent's absolute error per score; for 16-bit inputs the bound's
Delta holds u(dtype) (P's rounding in the sum l, which the kernels do not do), 2^-11 for float16,
so a softcap error of c 2^-21 is covered with a margin 2^10 / c (the tests below compute it)."""
import numpy as np
import pytest

EX2_REL = 2.0 ** -22          # ex2.approx.ftz.f32: 2 ulp (common.cuh: fast_exp2)
MAGIC = 0x7EF311C3            # variants.cuh: rcp_fma's first guess
LOG2E = 1.4426950408889634


def f32(x):
    return np.asarray(x, np.float64).astype(np.float32)


def fma32(a, b, c):
    """float32 fmaf: the float64 product of two float32 values is exact; one rounding after the
    addition (a double rounding through float64 is at most one float32 ulp in 2^29 cases away,
    far below what these tests resolve)."""
    return f32(np.float64(a) * np.float64(b) + np.float64(c))


def rcp_fma(y, steps=3):
    """variants.cuh: rcp_fma (steps = 3), in float32."""
    y = f32(y)
    r = (np.uint32(MAGIC) - y.view(np.uint32)).view(np.float32)
    for _ in range(steps):
        r = fma32(r, fma32(-y, r, 1.0), r)
    return r


def softcap_form1(t, c, ex2_rel=0.0, steps=3):
    """softcap_fast<1>(t, c, k) with k = 2 log2(e) / c as bind() forms it, in float32; ex2's
    result scaled by (1 + ex2_rel) to model its error."""
    t = f32(t)
    k = f32(2.0 * LOG2E / c)
    z = f32(t * k)                                           # x * k (one rounding)
    z = np.where(np.isnan(z), z, np.minimum(z, np.float32(64.0)))   # min.NaN.f32
    with np.errstate(over="ignore", invalid="ignore"):
        e = f32(np.exp2(z.astype(np.float64)) * (1.0 + ex2_rel))
        e = np.where(e < np.float32(2.0 ** -126), np.float32(0.0), e)   # .ftz
        r = rcp_fma(f32(1.0 + e.astype(np.float64)), steps)   # 1 + e (one rounding)
        cf = f32(c)
        return fma32(f32(-2.0 * cf), r, cf)


def _every_mantissa(binade=0):
    m = np.arange(2 ** 23, dtype=np.uint32) | np.uint32((127 + binade) << 23)
    return m.view(np.float32)


def test_rcp_fma_error_over_the_range():
    """Relative error of rcp_fma on [1, 2^64]: every float32 of [1, 2) (the first guess's error
    repeats per binade: the exponent enters linearly) and random mantissas of every binade up to
    2^64, against float64: below 1.001 2^-24 (rcp.approx's bound is 2^-23)."""
    y = _every_mantissa()
    rel = np.abs(rcp_fma(y).astype(np.float64) * y.astype(np.float64) - 1.0).max()
    assert rel <= 1.001 * 2.0 ** -24, rel / 2.0 ** -24
    rng = np.random.default_rng(0)
    for ex in range(1, 65):
        m = rng.integers(0, 2 ** 23, 20000, dtype=np.uint32) | np.uint32((127 + ex) << 23)
        yy = m.view(np.float32) if ex < 64 else np.array([2.0 ** 64], np.float32)
        r = rcp_fma(yy).astype(np.float64)
        assert np.abs(r * yy.astype(np.float64) - 1.0).max() <= 1.001 * 2.0 ** -24, ex
    assert rcp_fma(np.float32(1.0)) == np.float32(1.0)
    assert np.isnan(rcp_fma(np.float32(np.nan)))


def test_rcp_fma_two_steps_would_fail():
    """The bar above is not vacuous: with two Newton steps (one FFMA pair fewer) the first
    guess's 2^-4.3 becomes ~2^-17, far over it."""
    y = _every_mantissa()
    rel = np.abs(rcp_fma(y, steps=2).astype(np.float64) * y.astype(np.float64) - 1.0).max()
    assert rel > 2.0 ** -20


@pytest.mark.parametrize("c", [0.25, 1.0, 3.0, 30.0, 50.0])
def test_softcap_form1_error_whole_range(c):
    """|softcap_fast<1>(t) - c tanh(t / c)| over t / c in [-200, 200] (dense near 0 and around the
    saturation, then out to where e = 2^64 is clamped) and t = +-inf, with ex2's error both
    ways: below c 2^-21.5, the accuracy the MUFU form has (rcp.approx alone gives up to
    2c 2^-23 = c 2^-22). The margin against the 16-bit bound's slack u = 2^-11 (float16) is
    2^-11 / (c 2^-21.5) = 2^10.5 / c: > 25 for c <= 50."""
    rng = np.random.default_rng(1)
    x = np.concatenate([np.linspace(-200, 200, 400001), rng.uniform(-12, 12, 200000),
                        np.geomspace(1e-8, 1e-1, 2000), -np.geomspace(1e-8, 1e-1, 2000)])
    t = f32(x * c)
    exact = c * np.tanh(t.astype(np.float64) / c)
    worst = 0.0
    for pert in (-EX2_REL, 0.0, EX2_REL):
        got = softcap_form1(t, c, pert).astype(np.float64)
        worst = max(worst, float(np.abs(got - exact).max()))
    assert worst <= c * 2.0 ** -21.5, worst / c / 2.0 ** -24
    assert 2.0 ** -11 / worst > 25
    # the saturations: +inf gives c exactly (e clamped at 2^64: r = 2^-64), -inf gives -c to
    # within c 2^-23 (r = rcp_fma(1) = 1)
    hi, lo = softcap_form1(np.array([np.inf, -np.inf], np.float32), c)
    assert hi == f32(c) and abs(float(lo) + c) <= c * 2.0 ** -23
    assert np.isnan(softcap_form1(np.float32(np.nan), c))   # min.NaN keeps NaN


def test_softcap_form1_error_bar_can_fail():
    """The same bar rejects a form whose reciprocal is a few ulp worse (two Newton steps)."""
    t = f32(np.linspace(-20, 20, 100001))
    exact = np.tanh(t.astype(np.float64))
    assert np.abs(softcap_form1(t, 1.0, steps=2).astype(np.float64) - exact).max() > 2.0 ** -21.5


def test_softcap_form_dispatch(monkeypatch):
    """SOFTCAP_RCP_FMA puts SC_FORM = 1 (a sixth argument) in the tensor-core and Hopper
    policies and "softcap<fma-rcp>" in their labels, not in the generic kernels' (their softcap
    is tanh in the accumulator type) nor in policies without softcap; off, names are unchanged."""
    from cuflash import _dispatch_variants as DV
    for name in ("SOFTCAP_RCP_FMA", "VARIANT_FUSED_SCALE", "ALIBI_AFFINE"):
        monkeypatch.setattr(DV, name, False)   # (each form alone; the defaults: test_default_forms)
    sc, alibi = DV._Spec(softcap=True), DV._Spec(alibi=True)
    off = DV.hopper_variant_plan("float16", 128, True, 4096, sc)
    assert off.spec.name.endswith("cuflash::NoBias, false>>") and "fma-rcp" not in off.label
    monkeypatch.setattr(DV, "SOFTCAP_RCP_FMA", True)
    on = DV.hopper_variant_plan("float16", 128, True, 4096, sc)
    assert on.spec.name.endswith("cuflash::NoBias, false, 1>>"), on.spec.name
    assert "softcap<fma-rcp>" in on.label
    tc = DV.tensorcore_variant_plan("float16", 64, True, 90, sc)
    assert "false, 1>" in tc.spec.name and "softcap<fma-rcp>" in tc.label
    bwd = DV.bwd_tensorcore_variant_plan("float16", 64, True, False, 90, sc)
    assert any("false, 1>" in p.spec.name for _, p in bwd.passes)
    gen = DV.generic_variant_plan("float16", 64, 64, True, sc)
    assert "1>" not in gen.spec.name.split("Variant<")[1] and "fma-rcp" not in gen.label
    assert DV.policy_name(alibi).endswith("false>")
    assert DV.hopper_variant_plan("float16", 128, True, 4096, alibi).spec == \
        DV.hopper_variant_plan("float16", 128, True, 4096, alibi).spec


def test_form_compile_set():
    """The compile check builds the forms behind flags whatever the flags (precompile's sm_90
    list), FORM 1, 2 and 3, and leaves the flags as they were."""
    from cuflash import _dispatch_variants as DV
    from cuflash import precompile
    was = DV.SOFTCAP_RCP_FMA, DV.VARIANT_FUSED_SCALE
    specs = DV.form_compile_specs(90)
    assert (DV.SOFTCAP_RCP_FMA, DV.VARIANT_FUSED_SCALE) == was
    for bits in (1, 2, 3, 4, 6):
        assert any(f", {bits}>" in s.name for s in specs), bits
    assert all(any(f", {b}>" in s.name for b in (1, 2, 3, 4, 6)) for s in specs)
    families = {s.family for s in specs}
    assert {"attn_wgmma", "attn_mma", "attn_bwd_mma"} <= families, families
    allspecs = set(precompile.specialisations(90))
    assert all(s in allspecs for s in specs)


def test_fused_alibi_causal_form():
    """variants.cuh: fused_score's ALiBi under causal, fmaf(x, scale, fmaf(slope, ce, -slope
    dist0)), against float64 t - slope |dist| (dist = dist0 - ce >= 0, every key a causal row
    sees), over slopes of 2^-8 .. 1, distances to 2^17, raw products to +-2^9 and the forward's
    constant offsets ce < 128: within 3 roundings of the terms' size, 3 u (|t| + 2 |a|) (what
    error_bound's 12 u max(|s| + 2 |a|) holds). At dist < 0 (keys a causal row does not see) the
    form is -slope dist, not -slope |dist|: the test of that difference shows the bar can fail."""
    rng = np.random.default_rng(2)
    n = 400000
    slope = f32(2.0 ** rng.uniform(-8, 0, n))
    ce = f32(rng.integers(0, 128, n))
    dist = rng.integers(0, 2 ** 17, n).astype(np.float64)
    dist0 = f32(dist + ce.astype(np.float64))
    x = f32(rng.uniform(-512, 512, n))
    scale = f32(1.0 / np.sqrt(128.0))
    a = fma32(slope, ce, f32(-slope.astype(np.float64) * dist0.astype(np.float64)))
    got = fma32(x, scale, a).astype(np.float64)
    t = x.astype(np.float64) * float(scale)
    al = slope.astype(np.float64) * dist
    exact = t - al
    u = 2.0 ** -24
    assert np.all(np.abs(got - exact) <= 3 * u * (np.abs(t) + 2 * al) + 1e-30)
    # keys past the diagonal (dist < 0): the causal form gives -slope dist = +slope |dist|
    neg = fma32(slope, f32(ce.astype(np.float64) + 5.0), f32(-slope.astype(np.float64) * ce))
    assert np.all(neg.astype(np.float64) > 0)


def test_fused_scale_dispatch(monkeypatch):
    """VARIANT_FUSED_SCALE puts FORM bit 2 in the tensor-core and Hopper policies (3 with
    SOFTCAP_RCP_FMA) and "fused-scale" in their labels; not in the generic kernels', not with
    user hooks (their score is the unfused product's), and the plain plans are untouched."""
    from cuflash import _dispatch
    from cuflash import _dispatch_variants as DV
    from cuflash.mods import example_hooks
    for name in ("SOFTCAP_RCP_FMA", "VARIANT_FUSED_SCALE", "ALIBI_AFFINE"):
        monkeypatch.setattr(DV, name, False)
    plain = _dispatch.hopper_plan("float16", 128, True, 4096).spec
    monkeypatch.setattr(DV, "VARIANT_FUSED_SCALE", True)
    assert _dispatch.hopper_plan("float16", 128, True, 4096).spec == plain
    for sp in (DV._Spec(alibi=True), DV._Spec(window=True), DV._Spec(bias="float16")):
        pl = DV.hopper_variant_plan("float16", 128, True, 4096, sp)
        assert pl.spec.name.endswith(", 2>>"), pl.spec.name
        assert pl.label.endswith(",fused-scale>"), pl.label
        assert DV.tensorcore_variant_plan("float16", 64, True, 90, sp).spec.name.endswith(
            ", 2>>")
        gen = DV.generic_variant_plan("float16", 64, 64, True, sp)
        assert ", 2>" not in gen.spec.name and "fused" not in gen.label
    monkeypatch.setattr(DV, "SOFTCAP_RCP_FMA", True)
    assert DV.policy_name(DV._Spec(softcap=True)).endswith(", 3>")
    hooked = DV._with_mods(DV._Spec(alibi=True), example_hooks()["tanh_cap"], None)
    assert ", 2>" not in DV.policy_name(hooked) and "fused" not in DV.policy_label(hooked)


def test_alibi_affine_exponent():
    """The affine ALiBi form (variants.cuh: Variant::affine, affine_scores_as; common.cuh:
    softmax_step_affine) in float32: the exponent fmaf(y, a, b - m) with y = fmaf(x, scale /
    slope, ce), a = slope log2 e, b = -a dist0, against float64 log2 e (t - slope dist - m)
    (dist = dist0 - ce >= 0), slopes in [2^-10, 1], distances to 2^16, ce < 128 (BN <= 128):
    within 2^-24 (8 |t| + 12 slope (BN + dist)) + 4 ulp(m) in log2 units, which is under
    error_bound's 12 u max(|s| + 2|a|) plus 2^-15 (the margin to the 16-bit u = 2^-11 quoted in
    notes/VARIANTS.md). A slope above 1 is refused by affine() (the fallback form runs); the bar
    fails for the unfused mistake of leaving ce out (the test can fail)."""
    rng = np.random.default_rng(3)
    n = 400000
    slope = f32(2.0 ** rng.uniform(-10, 0, n))
    scale = f32(1.0 / np.sqrt(64.0))
    ce = f32(rng.integers(0, 128, n))
    dist = rng.integers(0, 2 ** 16, n).astype(np.float64)
    dist0 = f32(dist + ce.astype(np.float64))
    x = f32(rng.uniform(-400, 400, n))
    t = x.astype(np.float64) * float(scale)
    m = f32((t - slope.astype(np.float64) * dist) * LOG2E + rng.uniform(0, 30, n))
    rho = f32(np.float64(scale) / slope.astype(np.float64))
    a = f32(slope.astype(np.float64) * np.float32(LOG2E))
    y = fma32(x, rho, ce)
    b = f32(-a.astype(np.float64) * dist0.astype(np.float64))
    c = f32(b.astype(np.float64) - m.astype(np.float64))
    got = fma32(y, a, c).astype(np.float64)
    exact = LOG2E * (t - slope.astype(np.float64) * dist) - m.astype(np.float64)
    u = 2.0 ** -24
    bar = u * (8 * np.abs(t) + 12 * slope.astype(np.float64) * (128 + dist)) \
        + 4 * u * np.abs(m.astype(np.float64))
    assert np.all(np.abs(got - exact) <= bar)
    # in natural units, beyond 12 u (|s| + 2 |a|) with |s| >= |t| - |a|: at most 2^-15 here
    extra = np.maximum(np.abs(got - exact) / LOG2E
                       - 12 * u * (np.abs(t) + 2 * slope.astype(np.float64) * dist), 0)
    assert extra.max() <= 2.0 ** -15
    wrong = fma32(fma32(x, rho, np.float32(0)), a, c).astype(np.float64)   # ce left out
    assert np.any(np.abs(wrong - exact) > bar)


def test_alibi_affine_dispatch(monkeypatch):
    """ALIBI_AFFINE: FORM bit 4 and "alibi-affine" on the Hopper forward's ALiBi policies under
    causal with 16-bit inputs (alone, with a mask; 6 with the fused scale), nowhere else: not
    without causal, not float32, not with softcap, bias or window, not on the mma.sync kernels."""
    from cuflash import _dispatch_variants as DV
    for name in ("SOFTCAP_RCP_FMA", "VARIANT_FUSED_SCALE"):
        monkeypatch.setattr(DV, name, False)
    monkeypatch.setattr(DV, "ALIBI_AFFINE", True)
    al, am = DV._Spec(alibi=True), DV._Spec(alibi=True, mask=True)
    for sp in (al, am):
        pl = DV.hopper_variant_plan("float16", 128, True, 4096, sp)
        assert pl.spec.name.endswith(", 4>>") and pl.label.endswith(",alibi-affine>"), pl.label
    assert "affine" not in DV.hopper_variant_plan("float16", 128, False, 4096, al).label
    assert "affine" not in DV.hopper_variant_plan("float32", 64, True, 4096, al).label
    for sp in (DV._Spec(alibi=True, softcap=True), DV._Spec(alibi=True, window=True),
               DV._Spec(alibi=True, bias="float16")):
        assert "affine" not in DV.hopper_variant_plan("float16", 64, True, 4096, sp).label
    assert DV.tensorcore_variant_plan("float16", 64, True, 90, al).spec.name.endswith("false>>")
    monkeypatch.setattr(DV, "VARIANT_FUSED_SCALE", True)
    assert DV.hopper_variant_plan("float16", 128, True, 4096, al).spec.name.endswith(", 6>>")


def test_default_forms():
    """The forms by default: ALiBi's affine units on (the complete GPU suite passed with it, H200
    2026-12-02); the fused scale on (session j, 2026-12-03: its form and dispatch GPU cases
    passed with the mma.sync backward's rule, _dispatch_variants.fused_form) and softcap's
    FMA-pipe reciprocal off (0.64 against 0.65 per visited tile, session g call 3)."""
    from cuflash import _dispatch_variants as DV
    assert DV.ALIBI_AFFINE and DV.VARIANT_FUSED_SCALE and not DV.SOFTCAP_RCP_FMA
    al, sc = DV._Spec(alibi=True), DV._Spec(softcap=True)
    pl = DV.hopper_variant_plan("float16", 128, True, 4096, al)
    assert pl.spec.name.endswith(", 6>>") and "alibi-affine" in pl.label, pl.label
    assert DV.hopper_variant_plan("float16", 128, True, 4096, sc).spec.name.endswith(", 2>>")
    assert DV.tensorcore_variant_plan("float16", 64, True, 90, al).spec.name.endswith(", 2>>")


def _bwd_var_spec(plan):
    (spec,) = [p.spec for _, p in plan.passes if "_var<" in p.spec.name]
    return spec


def test_fused_scale_form_per_family(monkeypatch):
    """Which form each family's policy gets under VARIANT_FUSED_SCALE (_dispatch_variants.
    fused_form): the Hopper and mma.sync forwards the fused one (FORM bit 2) for every built-in
    policy at every head dim; the mma.sync backward the fused one below TC_BWD_FUSED_LIMIT_D
    (128) and, from it on, for policies of at most one transform (softcap, ALiBi or a bias;
    window and mask count none), the unfused one (no sixth argument, no "fused-scale" in the
    label) for two or more: window + softcap + ALiBi under causal spilled there under NVRTC 13.5
    with the fused form. Whatever the flag, the rule changes nothing with the flag off."""
    from cuflash import _dispatch_variants as DV
    for name in ("SOFTCAP_RCP_FMA", "VARIANT_FUSED_SCALE", "ALIBI_AFFINE"):
        monkeypatch.setattr(DV, name, False)
    S = DV._Spec
    one = [S(softcap=True), S(alibi=True), S(bias="float16"), S(window=True, softcap=True),
           S(window=True, alibi=True, mask=True)]
    none = [S(window=True), S(mask=True), S(window=True, mask=True)]
    two = [S(softcap=True, alibi=True), S(window=True, softcap=True, alibi=True),
           S(alibi=True, bias="float32"), S(softcap=True, bias="float16"),
           S(window=True, softcap=True, alibi=True, bias="float32", mask=True)]
    assert [DV.transforms(p) for p in one + none + two] == [1] * 5 + [0] * 3 + [2, 2, 2, 2, 3]
    assert DV.TC_BWD_FUSED_LIMIT_D == 128 and DV.TC_BWD_FUSED_MAX_TRANSFORMS == 1
    off = {}
    for pol in one + none + two:   # flag off: no policy of any family has the bit
        for dt in ("float16", "bfloat16"):
            for d in (64, 96, 128):
                spec = _bwd_var_spec(DV.bwd_tensorcore_variant_plan(dt, d, True, False, 90, pol))
                assert not spec.name.endswith(", 2>>"), spec.name
                off[(id(pol), dt, d)] = spec
    monkeypatch.setattr(DV, "VARIANT_FUSED_SCALE", True)
    for pol in one + none + two:
        for d in (64, 128, 256):
            h = DV.hopper_variant_plan("float16", d, True, 4096, pol)
            assert h.spec.name.endswith(", 2>>") and "fused-scale" in h.label, h.spec.name
            t = DV.tensorcore_variant_plan("float16", d, True, 90, pol)
            assert t.spec.name.endswith(", 2>>") and "fused-scale" in t.label, t.spec.name
        for dt in ("float16", "bfloat16"):
            for d, det, causal in ((64, False, True), (64, True, False), (96, False, True),
                                   (128, False, True), (128, True, False)):
                plan = DV.bwd_tensorcore_variant_plan(dt, d, causal, det, 90, pol)
                spec = _bwd_var_spec(plan)
                dpad = 64 if d == 64 else 128   # (TC_BWD_CONFIGS' buckets: 96 pads to 128)
                fused = dpad < 128 or DV.transforms(pol) <= 1
                assert spec.name.endswith(", 2>>") == fused, (d, spec.name)
                assert ("fused-scale" in plan.label) == fused, plan.label
                assert ("fused-scale" in [p for _, p in plan.passes
                                          if "_var<" in p.spec.name][0].label) == fused
                if not fused and not det and causal:   # the default form's kernel, exactly
                    assert spec == off[(id(pol), dt, d)]
    # the spilling specialisation of the brief: float16 D128 causal window + softcap + ALiBi
    bad = DV.bwd_tensorcore_variant_plan("float16", 128, True, False, 90, two[1])
    assert _bwd_var_spec(bad).name.endswith("cuflash::NoBias, false>>"), _bwd_var_spec(bad).name
    monkeypatch.setattr(DV, "SOFTCAP_RCP_FMA", True)   # FORM 3 -> 1 where the rule applies
    assert _bwd_var_spec(DV.bwd_tensorcore_variant_plan(
        "float16", 128, True, False, 90, two[1])).name.endswith(", 1>>")
    assert _bwd_var_spec(DV.bwd_tensorcore_variant_plan(
        "float16", 64, True, False, 90, two[1])).name.endswith(", 3>>")


def test_fused_scale_compile_set_follows_the_rule(monkeypatch):
    """With VARIANT_FUSED_SCALE on, the sm_90 compile set (precompile's list, what
    tests/test_compile.py builds) holds no mma.sync backward specialisation with FORM bit 2 at
    D >= TC_BWD_FUSED_LIMIT_D for a policy of two or more transforms (the brief's spilling one
    among them), holds the same specialisation unfused instead, and still holds the fused
    forwards of those policies; form_compile_specs, whatever the flag, adds only specs with FORM
    bits."""
    from cuflash import _dispatch_variants as DV
    from cuflash import precompile
    monkeypatch.setattr(DV, "VARIANT_FUSED_SCALE", True)
    names = [s.name for s in precompile.specialisations(90)]
    spill = ("cuflash::cuflash_bwd_mma_var<cuflash::fp16_t, 128, 32, 128, 8, 2, 1, true, false, "
             "0, cuflash::Variant<true, true, true, cuflash::NoBias, false")
    assert spill + ", 2>>" not in names and spill + ">>" in names
    for n in names:
        if n.startswith("cuflash::cuflash_bwd_mma_var<") and n.endswith(", 2>>"):
            dpad = int(n.split(",")[1])
            pol = n.split("cuflash::Variant<")[1]
            w, sc, al, bias = (x.strip() for x in pol.split(",")[:4])
            k = (sc == "true") + (al == "true") + (bias != "cuflash::NoBias")
            assert dpad < DV.TC_BWD_FUSED_LIMIT_D or k <= 1, n
    assert any("cuflash_fwd_wgmma_var<" in n and "Variant<true, true, true, cuflash::NoBias, "
               "false, 2>" in n for n in names)
    assert all(DV._has_form(s) for s in DV.form_compile_specs(90))
