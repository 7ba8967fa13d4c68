"""The float32 tensor-core backward's host side, without a GPU: dispatch (kernel="tensorcore"
takes float32 in its "3xfp16" form, kernel="auto" only with _dispatch.TC_BWD_F32_AUTO), the plan
(a tensor-core stats pass first, lse_acc, the dq accumulator), launch configurations within every
architecture's limits, the shared-memory formulas against the kernel's layout, and precision=
validation. GPU tests: tests/test_backward_gpu.py (test_f32_tensorcore_*); the compile check and
HMMA count: tests/test_compile.py (test_f32_tensorcore_backward_uses_fp16_mma)."""
import types

import numpy as np
import pytest

import cuflash
from cuflash import _dispatch


def _prob(**kw):
    base = dict(kernel="tensorcore", dtype_name="float32", d=64, dv=64, causal=False,
                deterministic=False, backend="gpu")
    base.update(kw)
    return types.SimpleNamespace(**base)


@pytest.mark.parametrize("cc", [80, 86, 89, 90])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("det", [False, True])
def test_tensorcore_float32_plan(cc, causal, det):
    bp = _dispatch.backward_plan_for(_prob(causal=causal, deterministic=det), cc)
    mask = "causal" if causal else "full"
    assert bp.label.startswith("tensorcore-bwd<float32,3xfp16,D64,"), bp.label
    assert bp.label.endswith(f"{'det,' if det else ''}{mask}>"), bp.label
    assert [g for g, _ in bp.passes] == ["rows", "keys", "dq_convert"]
    assert bp.lse_acc and bp.dq_accum_row == 64 + _dispatch.TC_BWD_DQ_PAD
    assert bp.deterministic == det
    (_, stats), (_, kern), _ = bp.passes
    assert stats.spec.name.startswith("cuflash::cuflash_bwd_stats_mma<64, ")
    assert kern.spec.name.startswith("cuflash::cuflash_bwd_mma<float, 64, ")
    assert kern.spec.name.endswith(", cuflash::fp16_t>")
    assert bp.block_m == stats.block_m and bp.block_n == kern.block_n
    limit = {80: 163, 86: 99, 89: 99, 90: 227}[cc] * 1024
    for plan in (stats, kern):
        assert plan.smem_bytes <= limit, (cc, plan.label, plan.smem_bytes)
        assert plan.threads <= 1024 and plan.threads % 32 == 0
    # two blocks an SM where the kernel's MINB asks for them (registers and shared memory)
    bm, nwarps, stages, minb, opt = _dispatch.TC_BWD_F16SPLIT_CONFIGS[64]
    assert not opt & _dispatch.TC_BWD_OPTS["lean"]
    if cc in (80, 90):
        assert minb * (kern.smem_bytes + 1024) <= {80: 164, 90: 228}[cc] * 1024


def test_smem_formulas_match_the_kernel_layout():
    """bwd_tensorcore_smem(f32=True) and bwd_stats_smem, written out from BwdMmaConfig<..., F32>
    and BwdStatsConfig (attn_bwd_mma.cu) by hand for the D = 64 tiles."""
    # K, V: 2 x 64 rows x 68 words; Q, dO: 1 stage x 2 x 32 rows x 68; dS^T hi + lo: 64 x 40
    # halves each = 64 x 40 words; m, delta, 1/l: 3 x 32 floats; 6 x 4 words
    want = (2 * 64 * 68 + 2 * 32 * 68 + 64 * 40) * 4 + 3 * 32 * 4 + 6 * 4 * 4
    assert _dispatch.bwd_tensorcore_smem(64, 32, 4, 1, f32=True) == want
    assert _dispatch.bwd_tensorcore_smem(64, 64, 4, 2) == (2 * 64 * 72 + 4 * 64 * 72
                                                           + 64 * 72) * 2 + 2 * 2 * 64 * 4
    assert _dispatch.bwd_stats_smem(64, 4, 64) == (2 * 64 + 2 * 64) * 68 * 4 + 16 * 4


def test_tensorcore_float32_refusals_and_auto(monkeypatch):
    for kw, why in ((dict(d=128, dv=128), "up to 64"), (dict(d=36, dv=36), "multiple of 8"),
                    (dict(dv=32), "D == Dv")):
        with pytest.raises(ValueError, match=f"kernel='tensorcore'.*{why}"):
            _dispatch.backward_plan_for(_prob(**kw), 90)
    with pytest.raises(ValueError, match="compute capability 8.0"):
        _dispatch.backward_plan_for(_prob(), 75)
    auto = _prob(kernel="auto", sq=_dispatch.TC_BWD_F32_MIN_SQ)
    monkeypatch.setattr(_dispatch, "TC_BWD_F32_AUTO", False)
    assert _dispatch.backward_plan_for(auto, 90).label.startswith("generic-bwd<float32,")
    assert "float16 and bfloat16" in _dispatch.backward_fallback_reason(auto, 90)
    monkeypatch.setattr(_dispatch, "TC_BWD_F32_AUTO", True)
    assert _dispatch.backward_plan_for(auto, 90).label.startswith(
        "tensorcore-bwd<float32,3xfp16,")
    assert _dispatch.backward_fallback_reason(auto, 90) is None
    short = _prob(kernel="auto", sq=_dispatch.TC_BWD_F32_MIN_SQ - 1)
    assert _dispatch.backward_plan_for(short, 90).label.startswith("generic-bwd<float32,")
    assert "Sq >=" in _dispatch.backward_fallback_reason(short, 90)
    forced = _prob(sq=1)  # kernel="tensorcore" refuses short rows: over the rule, never silently
    with pytest.raises(ValueError, match="kernel='tensorcore'.*Sq >="):
        _dispatch.backward_plan_for(forced, 90)
    enough = _prob(sq=_dispatch.TC_BWD_F32_MIN_SQ)
    assert _dispatch.backward_plan_for(enough, 90).label.startswith("tensorcore-bwd<float32,")
    wide = _prob(kernel="auto", d=128, dv=128, sq=1000)
    assert _dispatch.backward_plan_for(wide, 90).label.startswith("generic-bwd<float32,")
    assert "up to 64" in _dispatch.backward_fallback_reason(wide, 90)
    # the 16-bit paths are untouched by the flag
    half = _prob(kernel="tensorcore", dtype_name="float16")
    assert _dispatch.backward_plan_for(half, 90).label.startswith("tensorcore-bwd<float16,")


def test_float32_plans_are_compiled_and_not_varlen():
    """all_backward_specialisations lists the float32 plans (the compile check builds them);
    the varlen twins skip them (no _varlen form of the float32 kernels)."""
    for cc in (80, 90):
        names = [p.spec.name for bp in _dispatch.all_backward_specialisations(cc)
                 for _, p in bp.passes]
        assert any("cuflash_bwd_stats_mma<64" in n for n in names)
        assert any(n.endswith(", cuflash::fp16_t>") and "bwd_mma<float" in n for n in names)
        varlen = [s.name for s in _dispatch.varlen_backward_kernel_specs(cc)]
        assert not any("stats_mma" in n or "bwd_mma_varlen<float," in n for n in varlen)


def test_backward_precision_argument():
    """precision= is validated as in attention (CPU inputs: the NumPy backward, whatever it is)."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 5, 8)).astype(np.float32) for _ in range(3))
    o, lse = cuflash.attention(q, k, v, return_lse=True)
    ref = cuflash.attention_backward(o, q, k, v, o, lse)
    for prec in (None, "highest", "high", "default"):
        got = cuflash.attention_backward(o, q, k, v, o, lse, precision=prec)
        assert all(np.array_equal(a, b) for a, b in zip(got, ref))
    assert cuflash.backward_dispatch_info(o, q, k, v, o, lse, precision="high") == "cpu-numpy"
    with pytest.raises(ValueError, match="precision"):
        cuflash.attention_backward(o, q, k, v, o, lse, precision="fast")


def _model_case(seed_key, sq, sk, d, causal):
    from seeds import SEED, case_rng

    from gpu_util import random_backward_inputs
    return random_backward_inputs(case_rng(SEED, "f32tcmodel", *seed_key), (1,), (1,), sq, sk,
                                  d, d, "float32")


@pytest.mark.parametrize("sq,sk,d,causal", [(113, 200, 64, True), (130, 90, 40, False),
                                            (64, 333, 64, False)])
def test_model_meets_the_rule(sq, sk, d, causal):
    """The NumPy model of the kernels' arithmetic (tests/f32_bwd_tc_model.py) within the
    gradient rule on fresh draws at the row counts kernel="auto" would give it (Sq >= 64; at
    Sq = 1 the model fails the rule on 5-9% of draws: notes/BACKWARD.md)."""
    from cuflash import reference
    from f32_bwd_tc_model import f32_tc_backward_model

    q, k, v, do = _model_case((sq, sk, d, causal), sq, sk, d, causal)
    got = f32_tc_backward_model(do, q, k, v, causal=causal)
    ref = reference.attention_backward_ref(do, q, k, v, causal=causal)
    tols, _ = reference.grad_pass_threshold(do, q, k, v, causal=causal, dtype="float32", ref=ref)
    for name, g, r, tol in zip(("dq", "dk", "dv"), got, ref, tols):
        err = float(np.abs(g - r).max())
        assert err <= tol, f"model {name}: {err:.3e} > {tol:.3e} (Sq={sq}, Sk={sk}, D={d})"
