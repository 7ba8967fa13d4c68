"""NaN and inf in q, k and v (issue 16, defect 2): they reach exactly the rows that see them.

The rule (README, `cuflash.attention`'s docstring): a key that a row cannot see (masked) does
not touch that row, whatever its values; the rows that see a NaN or inf follow the float64
reference (a NaN or +inf score makes its row NaN, a NaN in v makes that column NaN in every row
that sees the key, an inf in v makes it inf or NaN). A plain masked product adds 0 * NaN = NaN
from a masked key to every row of its tile, which is what the references, the CPU path and the
generic kernel used to do.

The same cases run on the CPU path (always) and, with the `gpu` marker, on every GPU kernel
(generic, tensorcore, hopper) in every dtype it takes; rows are judged by the project's pass
rule (`reference.pass_threshold(...).judge`), which also demands NaN where the reference is NaN
and a non-finite value where it is inf.
"""
import math

import numpy as np
import pytest

import cuflash
from cuflash import reference as ref

NONFINITE = [np.nan, np.inf, -np.inf]


def _vid(x):
    return "nan" if np.isnan(x) else ("inf" if x > 0 else "-inf")


# (label, Sq, Sk, causal, tensor, index into that tensor (batch 0), meaning)
CASES = [
    # The issue's case: key 200 of 300, causal: rows 200..299 see it, rows 0..199 do not.
    ("v-key200-causal", 300, 300, True, "v", (200, 0)),
    # The last key, seen only by the last row.
    ("v-lastkey-causal", 300, 300, True, "v", (299, 5)),
    # The first key of the second 128-key tile with Sq < Sk (rows see keys j <= i + 100).
    ("v-key128-causal-sq<sk", 200, 300, True, "v", (128, 1)),
    ("k-key200-causal", 300, 300, True, "k", (200, 3)),
    ("q-row250-causal", 300, 300, True, "q", (250, 3)),
    # A query row that sees no key at all (Sq > Sk, causal): its output is 0, lse -inf.
    ("q-row10-sees-nothing", 300, 200, True, "q", (10, 0)),
    # Without the mask every row sees key 200.
    ("v-key200-full", 300, 300, False, "v", (200, 0)),
    ("k-key200-full", 300, 300, False, "k", (200, 3)),
]
CASE_IDS = [c[0] for c in CASES]


def _inputs(case, value, dtype, d, seed):
    _, sq, sk, causal, tensor, index = case
    rng = np.random.default_rng(seed)
    q = ref.round_to(rng.standard_normal((2, sq, d)), dtype)
    k = ref.round_to(rng.standard_normal((2, sk, d)), dtype)
    v = ref.round_to(rng.standard_normal((2, sk, d)), dtype)
    arrays = {"q": q, "k": k, "v": v}
    if case[0].startswith("q-row10"):
        arrays["q"][0, index[0], :] = value     # the whole row
    else:
        arrays[tensor][(0,) + index] = value
    return q, k, v, causal


def _expected_rows(case):
    """Rows (of batch 0) a non-finite k or v at key j reaches: those that see key j."""
    _, sq, sk, causal, tensor, index = case
    j = index[0]
    if not causal:
        return np.arange(sq)
    return np.arange(sq)[np.arange(sq) + (sk - sq) >= j]


def _judge(o, lse, q, k, v, causal, dtype):
    """Assert the pass rule on o (NaN/inf positions included) and the lse rule."""
    o_ref, lse_ref = ref.attention_ref(q, k, v, causal=causal)
    rule = ref.pass_threshold(q, k, v, causal=causal, dtype=dtype, o_ref=o_ref)
    verdict = rule.judge(np.asarray(o, dtype=np.float64))
    assert verdict.passed, verdict.reasons
    if lse is not None:
        lse = np.asarray(lse, dtype=np.float64)
        # NaN where the reference is NaN, -inf exactly for the rows that see no key, non-finite
        # where the reference is +inf (a +inf score: lse = +inf, or NaN as m + log(NaN) gives).
        assert np.all(np.isnan(lse[np.isnan(lse_ref)])), "lse NaN where the reference is"
        assert np.array_equal(np.isneginf(lse), np.isneginf(lse_ref))
        assert not np.any(np.isfinite(lse[np.isposinf(lse_ref)]))
        fin = np.isfinite(lse_ref)
        assert np.all(np.isfinite(lse[fin]))
        assert np.all(np.abs(lse[fin] - lse_ref[fin]) <= 1e-3 * np.maximum(1, np.abs(lse_ref[fin])))
    return o_ref


# ------------------------------------------------------------------------------------------------
# the references
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("value", NONFINITE, ids=_vid)
def test_reference_masked_key_touches_no_row(value):
    """The issue's reproduction, on (300, 16): exactly rows 200..299 are NaN (not all 300)."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((300, 16)) for _ in range(3))
    v[200, 0] = value
    o, lse = ref.attention_ref(q, k, v, causal=True)
    bad = np.flatnonzero(~np.isfinite(o[:, 0]))
    np.testing.assert_array_equal(bad, np.arange(200, 300))
    assert np.all(np.isfinite(o[:, 1:])) and np.all(np.isfinite(lse))
    if np.isnan(value):
        assert np.all(np.isnan(o[200:, 0]))
    for dtype in ("float16", "float32"):
        naive = ref.naive_attention(q, k, v, causal=True, dtype=dtype)
        np.testing.assert_array_equal(np.flatnonzero(~np.isfinite(naive[:, 0])),
                                      np.arange(200, 300))


def test_masked_matmul_matches_a_row_by_row_product():
    rng = np.random.default_rng(1)
    p = rng.random((2, 9, 12))
    v = rng.standard_normal((2, 12, 3))
    v[0, 4, 1] = np.nan
    v[1, 7, 2] = np.inf
    v[1, 8, 2] = -np.inf
    vis = np.tril(np.ones((9, 12), dtype=bool), 3)
    p = np.where(vis, p, 0.0)
    got = ref.masked_matmul(p, v, vis)
    want = np.empty_like(got)
    for b in range(2):
        for i in range(9):  # visible keys only (with np.errstate: inf - inf makes NaN here)
            js = np.flatnonzero(vis[i])
            with np.errstate(invalid="ignore"):
                want[b, i] = p[b, i, js] @ v[b, js]
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    fin = np.isfinite(want)
    np.testing.assert_allclose(got[fin], want[fin], rtol=1e-14, atol=1e-14)
    np.testing.assert_array_equal(got[~fin & ~np.isnan(want)], want[~fin & ~np.isnan(want)])


# ------------------------------------------------------------------------------------------------
# the CPU path
# ------------------------------------------------------------------------------------------------

def _cpu_dtypes():
    out = ["float16", "float32", "float64"]
    try:
        import ml_dtypes  # noqa: F401
        out.insert(1, "bfloat16")
    except ImportError:
        pass
    return out


def _np_dtype(name):
    if name == "bfloat16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def test_cpu_issue_reproduction():
    """(300, 16) float32, v[200, 0] = NaN, causal: rows 200..299 NaN, as the issue asks."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((300, 16)).astype(np.float32) for _ in range(3))
    v[200, 0] = np.nan
    o = cuflash.attention(q, k, v, causal=True)
    np.testing.assert_array_equal(np.flatnonzero(np.isnan(o[:, 0])), np.arange(200, 300))
    assert np.all(np.isfinite(o[:, 1:]))


@pytest.mark.parametrize("block_k", [16, 512])
@pytest.mark.parametrize("value", NONFINITE, ids=_vid)
@pytest.mark.parametrize("dtype", _cpu_dtypes())
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_cpu_path(case, dtype, value, block_k):
    from cuflash._cpu import attention_numpy

    q, k, v, causal = _inputs(case, value, dtype, 16, 7)
    npdt = _np_dtype(dtype)
    with np.errstate(invalid="ignore", over="ignore"):
        o, lse = attention_numpy(q.astype(npdt), k.astype(npdt), v.astype(npdt), causal=causal,
                                 scale=0.25, out=None, need_lse=True, block_k=block_k)
    _check_case(case, value, o, lse, q, k, v, causal, dtype, scale=0.25)


def _check_case(case, value, o, lse, q, k, v, causal, dtype, scale=None):
    o = np.asarray(o).astype(np.float64)
    if scale is not None:
        # _judge uses the default scale; rescale q so that both agree exactly (scale 0.25 = 1/4
        # = 1/sqrt(16): the default for D = 16).
        assert scale == 1 / math.sqrt(q.shape[-1])
    o_ref = _judge(o, lse, q, k, v, causal, dtype)
    label, sq, sk, _, tensor, index = case
    if tensor == "v":
        rows = _expected_rows(case)
        col = index[1]
        reached = np.flatnonzero(~np.isfinite(o[0, :, col]))
        np.testing.assert_array_equal(reached, rows)
        # no other column, and no other batch element, is touched
        assert np.all(np.isfinite(np.delete(o[0], col, axis=-1))) and np.all(np.isfinite(o[1]))
    elif label.startswith("q-row10"):
        assert np.all(o[0, index[0]] == 0) and np.isneginf(lse[0, index[0]])
        assert np.all(np.isfinite(o))
    else:
        # a non-finite q or k element: only the rows that see it may change
        rows = {"q": np.array([index[0]]), "k": _expected_rows(case)}[tensor]
        others = np.setdiff1d(np.arange(sq), rows)
        assert np.all(np.isfinite(o[0, others])) and np.all(np.isfinite(o[1]))
        if np.isnan(value):
            assert np.all(np.isnan(o[0, rows]))
    assert np.array_equal(np.isnan(o), np.isnan(o_ref))


# ------------------------------------------------------------------------------------------------
# every GPU kernel
# ------------------------------------------------------------------------------------------------

GPU_KERNELS = {"generic": ["float16", "bfloat16", "float32", "float64"],
               "tensorcore": ["float16", "bfloat16", "float32"],
               "hopper": ["float16", "bfloat16", "float32"]}
GPU_PARAMS = [(kern, dt) for kern, dts in GPU_KERNELS.items() for dt in dts]


@pytest.mark.gpu
@pytest.mark.parametrize("value", NONFINITE, ids=_vid)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("kernel,dtype", GPU_PARAMS, ids=[f"{a}-{b}" for a, b in GPU_PARAMS])
def test_gpu_kernel(kernel, dtype, case, value):
    from gpu_util import bf16_dtype, cupy, poisoned, to_gpu, to_host64

    if dtype == "bfloat16" and bf16_dtype() is None:
        pytest.skip("bfloat16 on the GPU needs ml_dtypes (CuPy's bfloat16 dtype)")
    cp = cupy()
    d = 64  # D == Dv, a multiple of 8 and >= 64: every kernel qualifies (on its GPU)
    q, k, v, causal = _inputs(case, value, dtype, d, 11)
    qg, kg, vg = (to_gpu(x, dtype) for x in (q, k, v))
    try:
        label = cuflash.dispatch_info(qg, kg, vg, causal=causal, kernel=kernel)
    except ValueError as exc:
        pytest.skip(f"kernel={kernel!r} does not run here: {exc}")
    assert label.startswith(kernel), label
    if kernel in ("tensorcore", "hopper") and dtype == "float32" and case[4] in ("k", "v") \
            and np.isinf(value):
        # Known defect, kept visible: the split-precision products (common.cuh: Tf32Split) turn
        # an infinite operand into hi = inf, lo = inf - inf = NaN, so an inf in k or v comes out
        # as NaN where the reference has inf (10 cases on the H200, 2026-12-01). The Hopper
        # float32 forms split K and V^T the same way (attn_wgmma.cu: split_tile, transpose_v;
        # the 3xfp16 form's split16_tile: inf * 2^e = inf, lo = NaN).
        pytest.xfail("float32 tensor-core split: an infinity in k or v becomes NaN")
    o = poisoned((2, q.shape[-2], v.shape[-1]), dtype)
    lse = poisoned((2, q.shape[-2]), "float32")
    cuflash.attention(qg, kg, vg, causal=causal, return_lse=True, out=(o, lse), kernel=kernel)
    cp.cuda.get_current_stream().synchronize()
    _check_case(case, value, to_host64(o), to_host64(lse), q, k, v, causal, dtype)
@pytest.mark.gpu
@pytest.mark.parametrize("value", NONFINITE, ids=_vid)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gpu_hopper_async_o(dtype, case, value, monkeypatch):
    """The Hopper kernel with its async O epilogue (_dispatch.HOPPER_ASYNC_O): a row that goes to
    the exact path (common.cuh: exact_row_pv; a non-finite O, e.g. a NaN in V at a key the row
    cannot see on a causal diagonal tile) is written there and must be left out of the bulk
    copies, which land asynchronously and would overwrite it with the tensor cores' NaN."""
    from cuflash import _dispatch

    from gpu_util import bf16_dtype, cupy, to_gpu

    if not cuflash.gpu_available() or int(cupy().cuda.Device().compute_capability) != 90:
        pytest.skip("the Hopper kernel needs a compute capability 9.0 GPU")
    if dtype == "bfloat16" and bf16_dtype() is None:
        pytest.skip("bfloat16 on the GPU needs ml_dtypes (CuPy's bfloat16 dtype)")
    monkeypatch.setattr(_dispatch, "HOPPER_ASYNC_O", True)
    q, k, v, causal = _inputs(case, value, dtype, 64, 11)
    qg, kg, vg = (to_gpu(x, dtype) for x in (q, k, v))
    label = cuflash.dispatch_info(qg, kg, vg, causal=causal, kernel="hopper")
    assert "asyncO" in label, label
    test_gpu_kernel("hopper", dtype, case, value)


def test_pass_rule_demands_the_reference_nan_positions():
    rng = np.random.default_rng(6)
    q, k, v = (ref.round_to(rng.standard_normal(s), "float32") for s in ((9, 8), (9, 8), (9, 4)))
    v[3, 1] = np.nan
    rule = ref.pass_threshold(q, k, v, causal=True, dtype="float32")
    assert np.isnan(rule.o_ref[3:, 1]).all() and np.isfinite(rule.o_ref[:3]).all()
    good = cuflash.attention(*(x.astype(np.float32) for x in (q, k, v)), causal=True)
    assert rule.judge(good).passed, rule.judge(good).reasons
    hidden = np.nan_to_num(good.astype(np.float64), nan=0.0)
    assert not rule.judge(hidden).passed
    assert math.isfinite(rule.threshold)
