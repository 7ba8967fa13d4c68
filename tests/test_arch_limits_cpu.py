"""Every tile configuration the dispatcher can pick on sm_80, sm_86, sm_89 and sm_90 fits that
architecture's per-block limits, without a GPU (no such GPU but the H200 has run the suite).

Shared memory: one block's opt-in maximum (`_dispatch.SMEM_OPTIN_BYTES`: 163, 99, 99 and
227 KiB), counting the static bytes of the varlen twins (`_varlen.VARLEN_STATIC_SMEM`,
`_varlen_backward.SEGMENT_VIEW_BYTES`) beside the plan's dynamic ones. Threads: at most 1024 a
block, and the mma.sync forward's `__launch_bounds__` minimum of blocks an SM at most the
SM's threads (2048 on 8.0 and 9.0, 1536 on 8.6 and 8.9). Registers: 64 Ki a SM and 255 a thread
on all four, so the compile check's sm_80 build (no spills, tests/test_compile.py) speaks for
sm_86 / sm_89 too; nothing more is checked here.

Before these tests only the tensor-core backward's tiles were checked per architecture
(tests/test_backward_cpu.py, 99 KiB for sm_86) and the Hopper varlen twin at 227 KiB
(tests/test_varlen_dense_cpu.py); the forward tables and the mma.sync varlen twin, whose 256
static bytes come on top of its dynamic ones, were checked on no architecture, which is how
the twin's D = 256 tiles (101376 + 256 bytes against 8.6 / 8.9's 101376) went unseen.
"""
from types import SimpleNamespace

import pytest

from cuflash import _dispatch, _tma, _varlen, _varlen_backward

ARCHS = (80, 86, 89, 90)
MAX_THREADS_PER_SM = {80: 2048, 86: 1536, 89: 1536, 90: 2048}

#: Known open: the generic kernel at float64 and D > 128 (the only float64 path) takes
#: 164224 bytes forward and 148800 backward, over 8.6 / 8.9's 99 KiB; the launch check refuses
#: it there by name ("needs N bytes of shared memory per block; this GPU allows M"). Listed so
#: that any other configuration over a limit fails these tests.
OPEN = {("generic", "float64", 256, 86), ("generic", "float64", 256, 89)}


def _arr(shape, item, ptr=1 << 30):
    st, acc = [], item
    for n in reversed(shape):
        st.insert(0, acc)
        acc *= n
    return SimpleNamespace(shape=shape, strides=tuple(st), itemsize=item,
                           data=SimpleNamespace(ptr=ptr), ndim=len(shape))


def _prob(dtype, d, kernel, precision, causal, sq=300):
    item = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}[dtype]
    x = _arr((2, 4, sq, d), item)
    return SimpleNamespace(backend="gpu", q=x, k=x, v=x, out=None, batch_shape=(2, 4), sq=sq,
                           sk=sq, d=d, dv=d, dtype_name=dtype, scale=0.125, causal=causal,
                           kernel=kernel, precision=precision, variant=None, stream=None,
                           device_id=0)


def _open(label, dtype, d, cc):
    return label.startswith(("generic<", "bwd_dq_generic<", "bwd_dkdv_generic<")) and \
        (label.split("<")[0].replace("bwd_dq_", "").replace("bwd_dkdv_", ""), dtype,
         256 if d > 128 else d, cc) in OPEN


def _dims():
    return sorted({8, 32, 64, 96, 128, 136, 192, 200, 256})


@pytest.mark.parametrize("cc", ARCHS)
def test_forward_plans_fit(cc, monkeypatch):
    """Every plan `plan_for` returns under kernel="auto" (every dtype, float32 precision, head
    dim bucket, mask) fits the architecture; kernel="tensorcore" on tiles that do not fit (the
    float32 TF32 ones at D >= 128 on 8.6 / 8.9, D = 256 on 8.0) says so instead of failing at
    the launch, and auto took the generic kernel for them."""
    monkeypatch.setattr(_tma, "available", lambda: True)
    limit = _dispatch.smem_optin_bytes(cc)
    for dtype in ("float16", "bfloat16", "float32", "float64"):
        for precision in ("highest", "high"):
            for d in _dims():
                for causal in (False, True):
                    plan = _dispatch.plan_for(_prob(dtype, d, "auto", precision, causal), cc)
                    if not _open(plan.label, dtype, d, cc):
                        assert plan.smem_bytes <= limit, (cc, plan.label, plan.smem_bytes)
                    assert plan.threads <= 1024
                    try:
                        tc = _dispatch.tensorcore_plan(dtype, d, causal, cc, precision)
                    except (ValueError, KeyError, TypeError):
                        continue   # no tensor-core form for these
                    if tc.smem_bytes > limit:
                        assert not plan.label.startswith("tensorcore<"), plan.label
                        with pytest.raises(ValueError, match="shared memory per block"):
                            _dispatch.plan_for(_prob(dtype, d, "tensorcore", precision,
                                                     causal), cc)


@pytest.mark.parametrize("cc", ARCHS)
def test_tensorcore_launch_bounds_fit_the_sm(cc):
    """The mma.sync forward's tables: warps x 32 x min blocks (its __launch_bounds__) within an
    SM's threads, so the register budget ptxas is given is one the SM can hold."""
    tables = [_dispatch.TC_CONFIGS, _dispatch.TC_F16SPLIT_CONFIGS, _dispatch.TC_F32_CONFIGS]
    tables += [t for a, t in _dispatch.TC_ARCH_CONFIGS.items() if a <= cc]
    tables += [t for a, t in _dispatch.TC_F32_ARCH_CONFIGS.items() if a <= cc]
    tables += [t for a, t in _dispatch.TC_VARLEN_ARCH_CONFIGS.items() if a <= cc]
    for table in tables:
        for key, cfg in table.items():
            if cfg is None:
                continue
            _bn, nwarps, _mt, minb, _staged = cfg
            assert 32 * nwarps * minb <= MAX_THREADS_PER_SM[cc], (cc, key, cfg)


@pytest.mark.parametrize("cc", ARCHS)
def test_varlen_tensorcore_twin_fits(cc):
    """The dense varlen forward's mma.sync twin with its static segment view, at every head-dim
    bucket, both 16-bit dtypes and masks: on 8.6 / 8.9 D = 256 takes its 48-key exception
    (TC_VARLEN_ARCH_CONFIGS[86]); the plain kernel's 64-key tiles needed 101632 bytes there."""
    limit = _dispatch.smem_optin_bytes(cc)
    for dt in ("float16", "bfloat16"):
        for dpad in _dispatch.TC_CONFIGS:
            for causal in (False, True):
                plan = _dispatch.varlen_tensorcore_plan(dt, dpad, causal, cc)
                need = plan.smem_bytes + _varlen.VARLEN_STATIC_SMEM[plan.spec.family]
                assert need <= limit, (cc, plan.label, need)
                assert _dispatch.smem_reason(plan, cc, 256) is None
    assert "BN48" in _dispatch.varlen_tensorcore_plan("float16", 256, True, 86).label
    assert "BN64" in _dispatch.varlen_tensorcore_plan("float16", 256, True, 90).label


def test_varlen_auto_refuses_a_twin_that_does_not_fit(monkeypatch):
    """Should a twin's tiles not fit (here: the exception removed), kernel="auto" takes the
    decode family and kernel="tensorcore" says why, instead of the launch's ValueError."""
    cu = SimpleNamespace(data=SimpleNamespace(ptr=1 << 20))
    q = _arr((600, 8, 256), 2)
    prob = SimpleNamespace(q=q, k=q, v=q, cu_q=cu, cu_k=cu, max_q=300, max_k=300, nseq=2, h=8,
                           hkv=8, d=256, dv=256, scale=0.1, causal=True, dtype_name="float16",
                           kernel="auto")
    assert _varlen.varlen_plan_for(prob, 86).label.startswith("varlen-tensorcore<float16,D256,")
    monkeypatch.setattr(_dispatch, "TC_VARLEN_ARCH_CONFIGS",
                        {a: {k: v for k, v in t.items() if k != 256}
                         for a, t in _dispatch.TC_VARLEN_ARCH_CONFIGS.items()})
    assert _varlen.varlen_plan_for(prob, 86).spec.family == "attn_decode"
    assert _varlen.varlen_plan_for(prob, 90).label.startswith("varlen-hopper<") or \
        _varlen.varlen_plan_for(prob, 90).label.startswith("varlen-tensorcore<")
    prob.kernel = "tensorcore"
    with pytest.raises(ValueError, match="101632 bytes of shared memory.*allows 101376"):
        _varlen.varlen_plan_for(prob, 89)


@pytest.mark.parametrize("cc", ARCHS)
def test_backward_plans_fit(cc):
    """Every backward plan `backward_plan_for` returns (auto, every dtype and head dim, both
    masks, deterministic or not) fits, and so do their varlen twins with the segment view."""
    limit = _dispatch.smem_optin_bytes(cc)
    for dtype in ("float16", "bfloat16", "float32", "float64"):
        for d in _dims():
            for causal in (False, True):
                for det in (False, True):
                    prob = SimpleNamespace(backend="gpu", dtype_name=dtype, d=d, dv=d, sq=300,
                                           sk=300, causal=causal, kernel="auto",
                                           deterministic=det, variant=None,
                                           precision="highest")
                    bp = _dispatch.backward_plan_for(prob, cc)
                    for plan in (bp.preprocess,) + tuple(p for _, p in bp.passes):
                        assert plan.threads <= 1024, plan.label
                        if _open(plan.label, dtype, d, cc):
                            continue
                        assert plan.smem_bytes <= limit, (cc, plan.label, plan.smem_bytes)
                        if not bp.label.startswith("hopper") and "3xfp16" not in bp.label:
                            assert plan.smem_bytes + _varlen_backward.SEGMENT_VIEW_BYTES \
                                <= limit, (cc, plan.label)


def test_the_open_list_is_still_open():
    """OPEN lists only configurations that are over their limit (remove an entry once fixed)."""
    for kind, dtype, d, cc in OPEN:
        assert kind == "generic"
        plan = _dispatch.generic_plan(dtype, d, d, False)
        assert plan.smem_bytes > _dispatch.smem_optin_bytes(cc), (dtype, d, cc)
