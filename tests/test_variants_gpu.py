"""GPU tests of the attention variants (window, softcap, ALiBi, bias, mask), forward on the generic
and the mma.sync tensor-core kernels (float16, bfloat16, float32: both; float64: generic), each
followed by the backward from that forward's o and lse (dbias included) on the same family
(the tensor-core backward for float16 / bfloat16 up to D = 128, else the generic one), against
the float64 references under the project's pass rule (reference.pass_threshold /
grad_pass_threshold), on fresh random inputs with every output poisoned with NaN. Tails,
Sq != Sk, causal on and off, broadcast heads, rows without keys. Skipped without a GPU."""
import numpy as np
import pytest

import cuflash
from cuflash import reference as R

from gpu_util import bf16_dtype, check_variant_case, cupy, random_inputs, to_gpu

pytestmark = pytest.mark.gpu

from seeds import SEED, case_rng  # noqa: E402  (fresh every run; see pytest's header)
SHAPES = [(7, 7), (113, 1000), (1000, 113), (1, 40)]
BATCH_Q, BATCH_KV = (2, 3), (1, 3)        # k and v shared across the leading axis


def _rng(*key):
    return case_rng(SEED, *key)


def _host_variant(name, rng, sq, sk, dtype):
    h = BATCH_Q[-1]
    bias_dt = "float32" if dtype != "float64" else "float64"
    m = rng.random(BATCH_Q + (sq, sk)) > 0.5
    m[..., ::4, :] = False                       # rows that see no key
    table = {
        "window": dict(window=(17, 3)),
        "window-0-0": dict(window=(0, 0)),
        "window-past-ends": dict(window=(10 ** 6, 10 ** 6)),
        "softcap": dict(softcap=2.0),
        "alibi": dict(alibi_slopes=rng.uniform(0.01, 0.3, (h,)).astype(np.float32)),
        "bias-f16-shared": dict(bias=R.round_to(rng.standard_normal((1, sk)), "float16")
                                .astype(np.float16)),
        "bias-head": dict(bias=rng.standard_normal((h, sq, sk)).astype(bias_dt)),
        "mask-empty-rows": dict(mask=m),
        "combined": dict(window=(40, 5), softcap=1.5,
                         alibi_slopes=rng.uniform(0.01, 0.3, BATCH_Q).astype(np.float32),
                         bias=rng.standard_normal((h, 1, sk)).astype(bias_dt),
                         mask=rng.random((sq, sk)) > 0.1),
    }
    return table[name]


def _to_device(kw):
    cp = cupy()
    return {n: (cp.asarray(x) if isinstance(x, np.ndarray) else x) for n, x in kw.items()}


CASES = ([(n, c, dt) for n in ("window", "combined") for c in (False, True)
          for dt in ("float16", "float32")]
         + [(n, False, dt) for n in ("window-0-0", "window-past-ends", "softcap", "alibi",
                                     "bias-f16-shared", "bias-head", "mask-empty-rows")
            for dt in ("float16", "float32")]
         + [("combined", c, dt) for c in (False, True) for dt in ("bfloat16", "float64")])


KERNEL_CASES = [c + (kern,) for c in CASES
                for kern in (("generic",) if c[2] == "float64" else ("generic", "tensorcore"))]


def _run_case(name, causal, dtype, sq, sk, kernel, d=64, kw=None, deterministic=False,
              bwd_kernel=None):
    if dtype == "bfloat16" and bf16_dtype() is None:
        pytest.skip("bfloat16 on the GPU needs ml_dtypes")
    rng = _rng(name, causal, dtype, sq, sk, kernel, d, deterministic)
    q, k, v = random_inputs(rng, BATCH_Q, BATCH_KV, sq, sk, d, d, dtype)
    kw = _host_variant(name, rng, sq, sk, dtype) if kw is None else kw
    dkw = _to_device(kw)
    qg, kg, vg = (to_gpu(x, dtype) for x in (q, k, v))
    if kernel == "hopper" and bwd_kernel is None:   # the backward of the same inputs
        bwd_kernel = "tensorcore" if dtype != "float32" and d <= 128 else "generic"
    return check_variant_case(q, k, v, qg, kg, vg, kw, dkw, causal=causal, dtype=dtype,
                              rng=rng, seed=SEED, kernel=kernel, deterministic=deterministic,
                              bwd_kernel=bwd_kernel)


@pytest.mark.parametrize("sq,sk", SHAPES)
@pytest.mark.parametrize("name,causal,dtype,kernel", KERNEL_CASES)
def test_variant_forward_backward(name, causal, dtype, kernel, sq, sk):
    _run_case(name, causal, dtype, sq, sk, kernel)


# The tensor-core tiles of the larger head dims (_dispatch_variants.TC_VARIANT_CONFIGS).
@pytest.mark.parametrize("name,causal,dtype,d", [
    ("combined", True, "float16", 96), ("combined", False, "float16", 128),
    ("window", True, "float16", 128), ("combined", True, "float16", 256),
    ("softcap", False, "bfloat16", 192), ("combined", True, "float32", 128)])
def test_variant_tensorcore_head_dims(name, causal, dtype, d):
    _run_case(name, causal, dtype, 113, 1000, "tensorcore", d=d)


# The tensor-core backward (cuflash_bwd_mma_var) with windows of several reaches: key blocks
# and query tiles skipped on both sides, the causal intersection, a window wider than the
# sequences; deterministic (dense turns over the visited key blocks; a second run equal bit for
# bit) and not, D = 64 and 128, Sq != Sk both ways, broadcast kv heads.
WINDOWS = [(0, 0), (1, 0), (16, 16), (100, 3), (-1, 33), (200, -1), (5, 10 ** 6)]


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("causal,det,dtype,d,sq,sk", [
    (False, True, "float16", 64, 300, 1000), (True, True, "bfloat16", 64, 1000, 300),
    (True, False, "float16", 128, 700, 700), (False, True, "float16", 128, 113, 1000)])
def test_variant_tensorcore_backward_windows(window, causal, det, dtype, d, sq, sk):
    _run_case(f"window{window}", causal, dtype, sq, sk, "tensorcore", d=d,
              kw=dict(window=window), deterministic=det)


# Every part on the tensor-core backward, deterministic (the dbias path's dscores written by one
# block per element; softcap's derivative; ALiBi and the mask), D = 64 and 128.
@pytest.mark.parametrize("name", ["combined", "softcap", "bias-head", "mask-empty-rows", "alibi"])
@pytest.mark.parametrize("d", [64, 128])
def test_variant_tensorcore_backward_deterministic(name, d):
    _run_case(name, name == "combined", "float16", 113, 250, "tensorcore", d=d,
              deterministic=True)


def _form_suffix():
    """What a tensor-core variant plan's label adds for the policy forms that are on (no user
    hooks, no ALiBi: _dispatch_variants.policy_label)."""
    from cuflash import _dispatch_variants
    return ",fused-scale" if _dispatch_variants.VARIANT_FUSED_SCALE else ""


def test_variant_backward_dispatch():
    """kernel="auto" takes the tensor-core backward for a float16 variant (the label names its
    parts); float32 falls back to the generic one and backward_dispatch_info says why;
    kernel="tensorcore" then raises naming the variant."""
    cp = cupy()
    q = cp.ones((1, 2, 64, 64), dtype=cp.float16)
    lse = cp.zeros((1, 2, 64), dtype=cp.float32)
    label = cuflash.backward_dispatch_info(q, q, q, q, q, lse, window=(8, 0), softcap=3.0)
    assert label.startswith("tensorcore-bwd<float16,D64,") and \
        label.endswith(",full,window,softcap" + _form_suffix() + ">"), label
    q32 = q.astype(cp.float32)
    label = cuflash.backward_dispatch_info(q32, q32, q32, q32, q32, lse, window=(8, 0))
    assert label.startswith("generic-bwd<float32,") and \
        "(tensor-core backward not used: it takes float16" in label, label
    with pytest.raises(ValueError, match=r"kernel='tensorcore' cannot run this backward with "
                                         r"the attention variant \(window\)"):
        cuflash.attention_backward(q32, q32, q32, q32, q32, lse, window=(8, 0),
                                   kernel="tensorcore")


def test_variant_dispatch():
    """kernel="auto" takes the mma.sync kernel for a variant (on sm_90 too, while
    _dispatch_variants.HOPPER_VARIANTS_AUTO is off), names the variant in the label; "hopper"
    takes the Hopper kernel on sm_90 and refuses elsewhere; float64 and D > 256 fall back to the
    generic kernel and say why; "tensorcore" then raises."""
    from cuflash import _dispatch_variants

    cp = cupy()
    q = cp.ones((1, 2, 64, 64), dtype=cp.float16)
    label = cuflash.dispatch_info(q, q, q, window=(8, 0))
    if _dispatch_variants.HOPPER_VARIANTS_AUTO and _hopper_device():
        assert label.startswith("hopper<float16,D64,") and \
            label.endswith(",full,window" + _form_suffix() + ">"), label
    else:
        assert label.startswith("tensorcore<float16,D64,") and \
            label.endswith(",full,window" + _form_suffix() + ">"), label
    assert cuflash.dispatch_info(q, q, q, softcap=3.0, causal=True).endswith(
        ",causal,softcap" + _form_suffix() + ">")
    if _hopper_device():
        label = cuflash.dispatch_info(q, q, q, softcap=3.0, kernel="hopper")
        assert label.startswith("hopper<float16,D64,") and label.endswith(",full,softcap" + _form_suffix() + ">"), \
            label
    else:
        with pytest.raises(ValueError, match="kernel='hopper'.*variant"):
            cuflash.attention(q, q, q, softcap=3.0, kernel="hopper")
    q64 = cp.ones((1, 2, 64, 64), dtype=cp.float64)
    label = cuflash.dispatch_info(q64, q64, q64, window=(8, 0))
    assert label.startswith("generic<float64,") and "tensor-core kernel cannot" in label, label
    with pytest.raises(ValueError, match="kernel='tensorcore' cannot run these inputs with the "
                                         "attention variant"):
        cuflash.attention(q64, q64, q64, window=(8, 0), kernel="tensorcore")


def test_plain_still_picks_fast_kernels():
    """No variant argument: the dispatcher is unchanged (the plain path does not route generic)."""
    cp = cupy()
    q = cp.ones((1, 2, 64, 64), dtype=cp.float16)
    assert not cuflash.dispatch_info(q, q, q).startswith("generic<float16,D64,full,")


# ---- The Hopper forward with a policy (attn_wgmma.cu: cuflash_fwd_wgmma_var), sm_90 only:
# the same cases as above (D64: float16, float32's 3xfp16 form, bfloat16), each with the
# backward from its o and lse; windows of several reaches at D64 and D128; the head dims whose
# tiles differ (_dispatch_variants.HOPPER_VARIANT_TILES); NaN and inf in v at keys a window or a
# mask hides from some rows (the epilogue's exact path, variants.cuh: exact_row_pv_var).

def _hopper_device():
    cp = cupy()
    return int(cp.cuda.Device().compute_capability) == 90


def _need_hopper():
    if not _hopper_device():
        pytest.skip("the Hopper kernel runs on compute capability 9.0 only")


HOPPER_CASES = [c for c in CASES if c[2] != "float64"]


@pytest.mark.parametrize("sq,sk", SHAPES)
@pytest.mark.parametrize("name,causal,dtype", HOPPER_CASES)
def test_variant_hopper_forward_backward(name, causal, dtype, sq, sk):
    _need_hopper()
    _run_case(name, causal, dtype, sq, sk, "hopper")


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("causal,dtype,d,sq,sk", [
    (False, "float16", 64, 300, 1000), (True, "bfloat16", 64, 1000, 300),
    (True, "float16", 128, 700, 700), (False, "float16", 128, 113, 1000)])
def test_variant_hopper_windows(window, causal, dtype, d, sq, sk):
    _need_hopper()
    _run_case(f"window{window}", causal, dtype, sq, sk, "hopper", d=d, kw=dict(window=window))


@pytest.mark.parametrize("name,causal,dtype,d", [
    ("combined", False, "float16", 128), ("window", True, "float16", 128),
    ("combined", True, "float16", 256), ("softcap", False, "bfloat16", 256),
    ("combined", True, "float32", 128)])
def test_variant_hopper_head_dims(name, causal, dtype, d):
    _need_hopper()
    _run_case(name, causal, dtype, 113, 1000, "hopper", d=d)


@pytest.mark.parametrize("value", [np.nan, np.inf], ids=["nan", "inf"])
@pytest.mark.parametrize("kind,causal", [("window", False), ("window", True), ("mask", False)])
def test_variant_hopper_nonfinite_v_at_hidden_keys(kind, causal, value):
    """A NaN / inf in v at a key hidden from some rows (by the window or the mask) reaches
    exactly the rows that see it; the other rows match the float64 reference under the pass
    rule (which also demands the non-finite values where the reference has them)."""
    _need_hopper()
    cp = cupy()
    sq, sk, d, key, col = 300, 300, 64, 200, 3
    rng = _rng("hopper-nonfinite", kind, causal, float(value))
    q, k, v = random_inputs(rng, BATCH_Q, BATCH_KV, sq, sk, d, d, "float16")
    v[(0,) * len(BATCH_KV) + (key, col)] = value
    if kind == "window":
        kw = dict(window=(40, 10))
    else:
        kw = dict(mask=rng.random((sq, sk)) > 0.3)
    dkw = _to_device(kw)
    qg, kg, vg = (to_gpu(x, "float16") for x in (q, k, v))
    o = cp.full(BATCH_Q + (sq, d), cp.nan, dtype=cp.float16)
    cuflash.attention(qg, kg, vg, causal=causal, out=o, kernel="hopper", **dkw)
    oh = cp.asnumpy(o).astype(np.float64)
    rule = R.pass_threshold(q, k, v, causal=causal, dtype="float16", **kw)
    verdict = rule.judge(oh)
    assert verdict.passed, (SEED, kind, causal, verdict.reasons)
    o_ref, _ = R.attention_ref(q, k, v, causal=causal, **kw)
    np.testing.assert_array_equal(~np.isfinite(oh), ~np.isfinite(o_ref))
    reached = ~np.isfinite(o_ref[..., col])
    assert reached.any() and not reached.all()   # the case hides the key from some rows


# The forms behind flags (notes/VARIANTS.md, "Forms behind flags"): softcap's reciprocal on the
# FMA pipe (_dispatch_variants.SOFTCAP_RCP_FMA; variants.cuh: rcp_fma, FORM bit 1) and the scale
# fused into the transform / raw scores without one (VARIANT_FUSED_SCALE, FORM bit 2: score_x,
# ALiBi under causal without |.|, softmax_units_log2), on the mma.sync and Hopper forwards and the
# mma.sync backward: large scores (q scaled so that |t| / c passes 4 both ways: both
# saturations), a small cap, ALiBi with and without causal (the causal form assumes dist >= 0 at
# visible keys), window edges, a bias, a mask with empty rows, every part combined; tails,
# Sq != Sk, NaN-poisoned outputs (check_variant_case).
FORMS = {"fma-rcp": dict(SOFTCAP_RCP_FMA=True), "fused": dict(VARIANT_FUSED_SCALE=True),
         "fma-rcp+fused": dict(SOFTCAP_RCP_FMA=True, VARIANT_FUSED_SCALE=True),
         "affine": dict(ALIBI_AFFINE=True),
         "affine+fused": dict(ALIBI_AFFINE=True, VARIANT_FUSED_SCALE=True)}
_SOFTCAP_FORM_CASES = (("softcap-large", False, "float16", 64),
                       ("softcap-large", True, "bfloat16", 64),
                       ("softcap-large", True, "float16", 128),
                       ("softcap-small-cap", True, "float16", 64),
                       ("softcap-window", False, "float16", 64),
                       ("softcap-window", True, "bfloat16", 128),
                       ("combined", True, "float16", 64),
                       ("combined", False, "bfloat16", 128))
_FUSED_CASES = (("alibi", False, "float16", 64), ("alibi", True, "float16", 64),
                ("alibi", True, "bfloat16", 128), ("window", False, "float16", 64),
                ("window", True, "float16", 128), ("window-0-0", True, "bfloat16", 64),
                ("bias-head", True, "float16", 64), ("bias-f16-shared", False, "float16", 128),
                ("mask-empty-rows", True, "float16", 64),
                # window + softcap + ALiBi at D128: the forward fused, the mma.sync backward
                # unfused (_dispatch_variants.fused_form: two transforms from D = 128 on)
                ("positional", True, "float16", 128))
# ALIBI_AFFINE (Hopper, causal, 16-bit): slopes in [2^-10, 1] (the affine form), slopes per
# (batch, head) on both sides of 1, 2^-10 and 0 (each batch entry's form: the affine one or the
# fallback), a mask with empty rows with it.
_AFFINE_CASES = (("alibi", True, "float16", 64), ("alibi", True, "bfloat16", 128),
                 ("alibi", True, "float16", 256), ("alibi-mixed-slopes", True, "float16", 64),
                 ("alibi-mixed-slopes", True, "float16", 128), ("alibi-mask", True, "float16", 64))
FORM_CASES = [(form, kern) + c for kern in ("tensorcore", "hopper")
              for form in ("fma-rcp", "fused", "fma-rcp+fused") for c in _SOFTCAP_FORM_CASES] + \
             [("fused", kern) + c for kern in ("tensorcore", "hopper") for c in _FUSED_CASES] + \
             [(form, "hopper") + c for form in ("affine", "affine+fused") for c in _AFFINE_CASES]


@pytest.mark.parametrize("sq,sk", SHAPES)
@pytest.mark.parametrize("form,kern,name,causal,dtype,d", FORM_CASES)
def test_variant_forms(form, kern, name, causal, dtype, d, sq, sk, monkeypatch):
    from cuflash import _dispatch_variants as DV
    if kern == "hopper":
        _need_hopper()
    if dtype == "bfloat16" and bf16_dtype() is None:
        pytest.skip("bfloat16 on the GPU needs ml_dtypes")
    for flag, value in FORMS[form].items():
        monkeypatch.setattr(DV, flag, value)
    rng = _rng("variant-forms", form, kern, name, causal, dtype, d, sq, sk)
    q, k, v = random_inputs(rng, BATCH_Q, BATCH_KV, sq, sk, d, d, dtype)
    if name.startswith("softcap"):
        q = R.round_to(q * 12.0, dtype)   # t = q.k / sqrt(D) ~ N(0, 12^2) at any D
        kw = dict(softcap=0.25 if name == "softcap-small-cap" else 3.0)
        if name == "softcap-window":
            kw["window"] = (17, 3)
    elif name == "alibi-mixed-slopes":
        kw = dict(alibi_slopes=np.array([[0.5, 1.0, 3.0], [0.0, 2.0 ** -11, -0.2]], np.float32))
    elif name == "positional":
        kw = dict(window=(40, 5), softcap=1.5,
                  alibi_slopes=rng.uniform(0.01, 0.3, BATCH_Q).astype(np.float32))
    elif name == "alibi-mask":
        kw = dict(alibi_slopes=rng.uniform(0.01, 0.3, BATCH_Q).astype(np.float32),
                  mask=_host_variant("mask-empty-rows", rng, sq, sk, dtype)["mask"])
    else:
        kw = _host_variant(name, rng, sq, sk, dtype)
    dkw = _to_device(kw)
    qg, kg, vg = (to_gpu(x, dtype) for x in (q, k, v))
    label = cuflash.dispatch_info(qg, kg, vg, causal=causal, kernel=kern, **dkw)
    if "SOFTCAP_RCP_FMA" in FORMS[form]:
        assert "softcap<fma-rcp>" in label, label
    if "VARIANT_FUSED_SCALE" in FORMS[form]:
        assert ",fused-scale" in label, label
    if "ALIBI_AFFINE" in FORMS[form]:
        assert label.endswith(",alibi-affine>"), label
    if d <= 128:   # the mma.sync backward: fused below D = 128 or with at most one transform
        cp = cupy()
        n_tr = sum(x in kw for x in ("softcap", "alibi_slopes", "bias"))
        # The flag as it is now (this form's setting, else its default: on since session j),
        # not whether the form names it: "fma-rcp" and "affine" run with the default too.
        fused = DV.VARIANT_FUSED_SCALE and (
            d < DV.TC_BWD_FUSED_LIMIT_D or n_tr <= DV.TC_BWD_FUSED_MAX_TRANSFORMS)
        blabel = cuflash.backward_dispatch_info(
            qg, qg, kg, vg, qg, cp.zeros(qg.shape[:-1], cp.float32), causal=causal,
            kernel="tensorcore", **dkw)
        assert ("fused-scale" in blabel) == fused, blabel
    check_variant_case(q, k, v, qg, kg, vg, kw, dkw, causal=causal, dtype=dtype, rng=rng,
                       seed=SEED, kernel=kern,
                       bwd_kernel="tensorcore" if d <= 128 else "generic")
    if name.startswith("softcap"):   # the case reaches both saturations
        s = np.einsum("...id,...jd->...ij", q, np.broadcast_to(k, q.shape[:-2] + k.shape[-2:]))
        s /= np.sqrt(d) * kw["softcap"]
        assert s.max() > 4 and s.min() < -4
