"""The backward pass without a GPU: the float64 reference gradients against central finite
differences, the naive same-precision backward and the gradient pass rule, the NumPy backward
(cuflash.attention_backward on NumPy inputs) against the float64 reference, the argument checks,
and the backward's host-side plan and launch logic (parameter block, grids, workspace) with
stand-in arrays."""
import math
import types
import zlib

import numpy as np
import pytest

import cuflash
from cuflash import _compile, _dispatch, _launch
from cuflash import reference as ref
from cuflash._cpu_backward import attention_backward_numpy

DTYPES = ["float16", "float32", "float64"]
try:
    import ml_dtypes  # noqa: F401

    DTYPES.append("bfloat16")
except ImportError:  # pragma: no cover - the test extra installs it with CuPy
    pass


def _rng(*parts):
    return np.random.default_rng(zlib.crc32(repr(parts).encode()))


def _problem(rng, dtype, qb, kb, vb, sq, sk, d, dv):
    """float64 q, k, v, do holding values representable in dtype (never zeros)."""
    batch = np.broadcast_shapes(qb, kb, vb)
    q = ref.round_to(rng.standard_normal(qb + (sq, d)) * 1.5, dtype)
    k = ref.round_to(rng.standard_normal(kb + (sk, d)), dtype)
    v = ref.round_to(rng.standard_normal(vb + (sk, dv)), dtype)
    do = ref.round_to(rng.standard_normal(batch + (sq, dv)), dtype)
    return q, k, v, do


def _np(x, dtype):
    return np.asarray(x).astype(np.dtype(dtype))


def _forward(q, k, v, dtype, causal, scale=None):
    """o and lse as cuflash.attention returns them (the NumPy path), in dtype."""
    return cuflash.attention(_np(q, dtype), _np(k, dtype), _np(v, dtype), causal=causal,
                             scale=scale, return_lse=True)


def _check_grads(got, q, k, v, do, *, causal, scale, dtype):
    """Assert the gradient pass rule for each of dq, dk, dv, and shapes, dtypes, no NaN."""
    g_ref = ref.attention_backward_ref(do, q, k, v, causal=causal, scale=scale)
    tols, naive = ref.grad_pass_threshold(do, q, k, v, causal=causal, scale=scale, dtype=dtype,
                                          ref=g_ref)
    errs = []
    for name, g, r, tol, ne, x in zip(("dq", "dk", "dv"), got, g_ref, tols, naive, (q, k, v)):
        assert g.shape == x.shape, f"{name} has shape {g.shape}, expected {x.shape}"
        assert g.dtype == np.dtype(dtype), f"{name} has dtype {g.dtype}, expected {dtype}"
        g64 = g.astype(np.float64)
        assert not np.isnan(g64).any(), f"{name}: {int(np.isnan(g64).sum())} NaN elements"
        err = float(np.max(np.abs(g64 - r)))
        assert err <= tol, (f"{name}: max abs error {err:.3e} > threshold {tol:.3e} "
                            f"(naive {dtype} backward: {ne:.3e})")
        errs.append(err)
    return errs


# ---------------------------------------------------------------------------------------------
# References

FD_CASES = [  # (q batch, k batch, v batch, Sq, Sk, D, Dv, causal)
    ((), (), (), 3, 4, 3, 2, False),
    ((2,), (2,), (2,), 4, 3, 2, 3, True),     # Sq > Sk: the first row sees no key
    ((2, 1), (1, 2), (2, 2), 3, 5, 3, 2, True),
    ((1, 3), (1, 1), (1, 1), 2, 3, 4, 4, False),  # MQA: dk, dv summed over the heads
]


@pytest.mark.parametrize("qb,kb,vb,sq,sk,d,dv,causal", FD_CASES)
def test_reference_matches_finite_differences(qb, kb, vb, sq, sk, d, dv, causal):
    rng = _rng("fd", qb, kb, vb, sq, sk, d, dv, causal)
    q, k, v, do = _problem(rng, "float64", qb, kb, vb, sq, sk, d, dv)
    scale = 0.7
    analytic = ref.attention_backward_ref(do, q, k, v, causal=causal, scale=scale)
    numeric = ref.attention_backward_fd(do, q, k, v, causal=causal, scale=scale)
    for name, a, n, x in zip(("dq", "dk", "dv"), analytic, numeric, (q, k, v)):
        assert a.shape == x.shape and n.shape == x.shape
        err = float(np.max(np.abs(a - n)))
        assert err <= 1e-8 * max(1.0, float(np.max(np.abs(a)))), f"{name}: {err:.3e}"
        assert np.max(np.abs(a)) > 1e-3, f"{name} is ~0: the check would be vacuous"


def test_cpu_backward_matches_finite_differences():
    """The NumPy backward (float64, small tiles) against central differences directly."""
    rng = _rng("fd-cpu")
    q, k, v, do = _problem(rng, "float64", (2, 1), (2, 2), (2, 2), 5, 6, 3, 2)
    o, lse = _forward(q, k, v, "float64", True, scale=0.5)
    got = attention_backward_numpy(do, q, k, v, o, lse, causal=True, scale=0.5, block_k=2)
    numeric = ref.attention_backward_fd(do, q, k, v, causal=True, scale=0.5)
    for g, n in zip(got, numeric):
        assert float(np.max(np.abs(g - n))) <= 1e-8 * max(1.0, float(np.max(np.abs(n))))


def test_reference_rows_without_keys_get_zero_gradient():
    rng = _rng("empty")
    q, k, v, do = _problem(rng, "float64", (2,), (2,), (2,), 9, 4, 3, 3)
    with np.errstate(all="raise"):
        dq, dk, dv = ref.attention_backward_ref(do, q, k, v, causal=True)
    assert np.all(dq[:, :5] == 0) and np.all(np.isfinite(dq))
    assert np.any(dq[:, 5:] != 0)
    assert np.all(np.isfinite(dk)) and np.all(np.isfinite(dv))


def test_naive_backward_float64_is_the_reference():
    rng = _rng("naive64")
    q, k, v, do = _problem(rng, "float64", (2,), (1,), (1,), 7, 9, 5, 4)
    for causal in (False, True):
        a = ref.attention_backward_ref(do, q, k, v, causal=causal)
        n = ref.naive_attention_backward(do, q, k, v, causal=causal, dtype="float64")
        for x, y in zip(a, n):
            np.testing.assert_allclose(y, x, rtol=0, atol=1e-12)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_naive_backward_is_representable_and_close(dtype):
    rng = _rng("naive", dtype)
    q, k, v, do = _problem(rng, dtype, (2,), (2,), (2,), 16, 20, 8, 8)
    a = ref.attention_backward_ref(do, q, k, v, causal=True)
    n = ref.naive_attention_backward(do, q, k, v, causal=True, dtype=dtype)
    u = ref.unit_roundoff(dtype)
    for x, y in zip(a, n):
        np.testing.assert_array_equal(ref.round_to(y, dtype), y)
        err = float(np.max(np.abs(x - y)))
        assert 0 < err < 200 * u * max(1.0, float(np.max(np.abs(x))))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_grad_pass_threshold_is_the_forward_rule(dtype):
    """grad_pass_threshold applies reference.tolerance to each gradient: no second formula."""
    rng = _rng("rule", dtype)
    q, k, v, do = _problem(rng, dtype, (2,), (1,), (1,), 9, 11, 6, 5)
    g_ref = ref.attention_backward_ref(do, q, k, v, causal=True)
    tols, errs = ref.grad_pass_threshold(do, q, k, v, causal=True, dtype=dtype, ref=g_ref)
    scales = ref.gradient_scales(do, q, k, v, causal=True)
    assert errs == ref.naive_gradient_errors(do, q, k, v, causal=True, dtype=dtype, ref=g_ref)
    lse_rel = ref.backward_lse_error(q, k, v, causal=True, dtype=dtype)
    assert (lse_rel == 0) == (dtype in ("float32", "float64"))
    for t, r, e, a in zip(tols, g_ref, errs, scales):
        assert t == ref.tolerance(dtype, r, e, out_scale=a) + lse_rel * a
        assert a >= float(np.max(np.abs(r)))  # A_X bounds max|X|
    if dtype == "float64":
        assert errs == ref.naive_gradient_error_bound_f64(do, q, k, v, causal=True)


def test_rule_rejects_a_wrong_gradient():
    """The threshold is tight enough to catch a gradient that misses one key tile's terms."""
    rng = _rng("reject")
    q, k, v, do = _problem(rng, "float16", (2,), (2,), (2,), 64, 64, 32, 32)
    g_ref = ref.attention_backward_ref(do, q, k, v)
    tols, _ = ref.grad_pass_threshold(do, q, k, v, dtype="float16", ref=g_ref)
    partial = ref.attention_backward_ref(do, q, k[..., :56, :], v[..., :56, :])
    for name, r, wrong, tol in zip(("dq", "dk", "dv"), g_ref, partial, tols):
        if name != "dq":
            r = r[..., :56, :]
        assert float(np.max(np.abs(wrong - r))) > tol, name


# ---------------------------------------------------------------------------------------------
# The NumPy backward

SHAPES = [(1, 1), (7, 7), (113, 113), (1, 113), (113, 1), (113, 7), (7, 113), (300, 64)]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_backward_matches_reference(dtype, sq, sk, causal):
    d, dv = [(16, 16), (64, 32), (40, 64), (1, 3)][(sq + sk) % 4]
    rng = _rng("cpu", dtype, sq, sk, causal)
    q, k, v, do = _problem(rng, dtype, (2, 3), (2, 3), (2, 3), sq, sk, d, dv)
    o, lse = _forward(q, k, v, dtype, causal)
    out = tuple(np.full(x.shape, np.nan, dtype=np.dtype(dtype)) for x in (q, k, v))
    got = cuflash.attention_backward(_np(do, dtype), _np(q, dtype), _np(k, dtype),
                                     _np(v, dtype), o, lse, causal=causal, out=out)
    assert all(g is b for g, b in zip(got, out))
    _check_grads(got, q, k, v, do, causal=causal, scale=None, dtype=dtype)


@pytest.mark.parametrize("qb,kb,vb", [((2, 4), (2, 1), (2, 1)), ((1, 4), (3, 4), (3, 4)),
                                      ((2, 4), (1, 4), (2, 1)), ((3,), (2, 1, 1), (1, 3))])
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_cpu_backward_broadcast_axes_are_summed(dtype, qb, kb, vb):
    rng = _rng("bcast", dtype, qb, kb, vb)
    q, k, v, do = _problem(rng, dtype, qb, kb, vb, 37, 50, 16, 8)
    o, lse = _forward(q, k, v, dtype, True)
    got = cuflash.attention_backward(_np(do, dtype), _np(q, dtype), _np(k, dtype),
                                     _np(v, dtype), o, lse, causal=True)
    _check_grads(got, q, k, v, do, causal=True, scale=None, dtype=dtype)


@pytest.mark.parametrize("dtype", ["float16", "float64"])
def test_cpu_backward_strided_inputs(dtype):
    """(B, S, H, D) buffers seen as (B, H, S, D), and a last axis that is not contiguous."""
    rng = _rng("strided", dtype)
    B, H, S, D = 2, 3, 45, 16
    qb, kb, vb, dob = (ref.round_to(rng.standard_normal((B, S, H, D)), dtype) for _ in range(4))
    q, k, v, do = (np.swapaxes(x, 1, 2) for x in (qb, kb, vb, dob))
    wide = ref.round_to(rng.standard_normal((B, H, S, 2 * D)), dtype)
    v = wide[..., ::2]  # last axis stride 2
    o, lse = _forward(q, k, v, dtype, False)
    views = [np.swapaxes(_np(x, dtype), 1, 2) for x in (qb, kb, dob)]
    vv = _np(wide, dtype)[..., ::2]
    got = cuflash.attention_backward(views[2], views[0], views[1], vv, o, lse)
    _check_grads(got, q, k, v, do, causal=False, scale=None, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_backward_rows_without_keys(dtype):
    """Causal with Sq > Sk: the first Sq - Sk rows see no key: zero dq, never NaN."""
    rng = _rng("nokey", dtype)
    q, k, v, do = _problem(rng, dtype, (2,), (2,), (2,), 40, 9, 8, 8)
    o, lse = _forward(q, k, v, dtype, True)
    assert np.all(np.isneginf(lse[:, :31]))
    with np.errstate(all="raise"):
        got = cuflash.attention_backward(_np(do, dtype), _np(q, dtype), _np(k, dtype),
                                         _np(v, dtype), o, lse, causal=True)
    assert np.all(got[0][:, :31].astype(np.float64) == 0)
    _check_grads(got, q, k, v, do, causal=True, scale=None, dtype=dtype)


@pytest.mark.parametrize("block_k", [1, 5, 128])
def test_cpu_backward_block_k(block_k):
    rng = _rng("bk", block_k)
    q, k, v, do = _problem(rng, "float32", (2,), (2,), (2,), 29, 31, 8, 8)
    o, lse = _forward(q, k, v, "float32", True)
    got = attention_backward_numpy(*(_np(x, "float32") for x in (do, q, k, v)), o, lse,
                                   causal=True, scale=8 ** -0.5, block_k=block_k)
    _check_grads(got, q, k, v, do, causal=True, scale=None, dtype="float32")


def test_cpu_backward_is_deterministic_and_scaled():
    rng = _rng("det")
    q, k, v, do = _problem(rng, "float32", (2,), (2,), (2,), 33, 20, 8, 8)
    o, lse = _forward(q, k, v, "float32", False, scale=-0.3)
    args = [_np(x, "float32") for x in (do, q, k, v)]
    a = cuflash.attention_backward(*args, o, lse, scale=-0.3, deterministic=True)
    b = cuflash.attention_backward(*args, o, lse, scale=-0.3)
    for x, y in zip(a, b):
        assert x.tobytes() == y.tobytes()
    _check_grads(a, q, k, v, do, causal=False, scale=-0.3, dtype="float32")


def test_cpu_backward_two_dimensional():
    rng = _rng("2d")
    q, k, v, do = _problem(rng, "float64", (), (), (), 11, 13, 4, 6)
    o, lse = _forward(q, k, v, "float64", True)
    got = cuflash.attention_backward(do, q, k, v, o, lse, causal=True)
    _check_grads(got, q, k, v, do, causal=True, scale=None, dtype="float64")


# ---------------------------------------------------------------------------------------------
# Argument checks

def _valid():
    rng = _rng("args")
    q, k, v, do = (x.astype(np.float32) for x in _problem(rng, "float32", (2,), (2,), (2,), 5,
                                                           6, 4, 3))
    o, lse = cuflash.attention(q, k, v, return_lse=True)
    return do, q, k, v, o, lse


BAD = [
    (lambda a: (a[0][..., :2], *a[1:]), {}, ValueError, r"do has shape \(2, 5, 2\); expected \(2, 5, 3\)"),
    (lambda a: (*a[:4], a[4][:, :4], a[5]), {}, ValueError, r"^o has shape"),
    (lambda a: (*a[:5], a[5].astype(np.float64)), {}, TypeError, "lse has dtype float64; expected float32"),
    (lambda a: (a[0].astype(np.float64), *a[1:]), {}, TypeError, "do has dtype float64; expected float32"),
    (lambda a: (*a[:5], a[5][:, :3]), {}, ValueError, r"lse has shape \(2, 3\); expected \(2, 5\)"),
    (lambda a: a, {"deterministic": 1}, TypeError, "deterministic must be a bool"),
    (lambda a: a, {"causal": "yes"}, TypeError, "causal must be a bool"),
    (lambda a: a, {"kernel": "generic"}, ValueError, "selects a GPU kernel"),
    (lambda a: a, {"kernel": "fast"}, ValueError, "kernel must be one of"),
    (lambda a: a, {"stream": 0}, ValueError, "stream= applies to GPU inputs only"),
    (lambda a: a, {"workspace": np.zeros(64, np.uint8)}, ValueError, "workspace= applies to GPU"),
    (lambda a: a, {"out": (np.zeros((2, 5, 4), np.float32),)}, ValueError, r"out must be a tuple \(dq, dk, dv\)"),
    (lambda a: a, {"out": (np.zeros((2, 5, 4), np.float32), np.zeros((2, 6, 4), np.float32),
                           np.zeros((2, 6, 4), np.float32))}, ValueError, r"out\[2\] \(dv\) has shape"),
    (lambda a: a, {"out": (np.zeros((2, 5, 4), np.float16), np.zeros((2, 6, 4), np.float32),
                           np.zeros((2, 6, 3), np.float32))}, TypeError, r"out\[0\] \(dq\) has dtype float16"),
    (lambda a: a, {"out": (np.zeros((2, 5, 4), np.float32),
                           np.broadcast_to(np.zeros((1, 6, 4), np.float32), (2, 6, 4)),
                           np.zeros((2, 6, 3), np.float32))}, ValueError, r"out\[1\] \(dk\)"),
    (lambda a: (a[0], a[1][..., :3], *a[2:]), {}, ValueError, "k has head dim 4 but q has 3"),
    (lambda a: (a[0], a[1], a[2], a[3].astype(np.float16), *a[4:]), {}, TypeError, "same dtype"),
    (lambda a: a, {"scale": float("nan")}, ValueError, "scale must be finite"),
]


@pytest.mark.parametrize("edit,kwargs,exc,match", BAD)
def test_backward_bad_input(edit, kwargs, exc, match):
    args = edit(_valid())
    with pytest.raises(exc, match=match):
        cuflash.attention_backward(*args, **kwargs)


def test_backward_info_on_cpu():
    args = _valid()
    assert cuflash.backward_dispatch_info(*args) == "cpu-numpy"
    assert cuflash.attention_backward_workspace_size(*args) == 0


# ---------------------------------------------------------------------------------------------
# Plans and the launch logic, with stand-in arrays (no GPU)

class FakeArray:
    """What launch_backward reads from a CuPy array."""

    def __init__(self, shape, ptr, itemsize=2, elem_strides=None):
        self.shape, self.itemsize, self.ndim = tuple(shape), itemsize, len(shape)
        if elem_strides is None:
            elem_strides = [int(np.prod(shape[i + 1:])) for i in range(len(shape))]
        self.strides = tuple(s * itemsize for s in elem_strides)
        self.data = types.SimpleNamespace(ptr=ptr)
        self.nbytes = int(np.prod(shape)) * itemsize


@pytest.fixture
def launches(monkeypatch):
    record = []

    def get_kernel(spec, dev, smem=0):
        def kernel(grid, block, args, shared_mem=0, stream=None):
            record.append((spec.name, grid[0], block[0], args[0], shared_mem))
        return kernel

    monkeypatch.setattr(_compile, "get_kernel", get_kernel)
    monkeypatch.setattr(_launch, "_stream_ptr", lambda s: None)
    return record


ATTRS = {"max_smem_optin": 232448, "sm_count": 132, "compute_capability": 90}


def _bwd_problem(qb, kb, vb, sq, sk, d, dv, dtype="float16"):
    item = np.dtype(dtype).itemsize if dtype != "bfloat16" else 2
    batch = tuple(np.broadcast_shapes(qb, kb, vb))
    ptr = iter(range(1 << 24, 1 << 40, 1 << 24))
    q, k, v = (FakeArray(b + s, next(ptr), item) for b, s in ((qb, (sq, d)), (kb, (sk, d)),
                                                               (vb, (sk, dv))))
    o, do = (FakeArray(batch + (sq, dv), next(ptr), item) for _ in range(2))
    lse = FakeArray(batch + (sq,), next(ptr), 4)
    grads = [FakeArray(x.shape, next(ptr), item) for x in (q, k, v)]
    prob = types.SimpleNamespace(q=q, k=k, v=v, o=o, do=do, lse=lse, batch_shape=batch, sq=sq,
                                 sk=sk, d=d, dv=dv, dtype_name=dtype, scale=0.125, stream=None,
                                 device_id=0, deterministic=False, causal=True,
                                 kernel="generic")
    return prob, grads


def test_bwd_params_match_the_struct():
    """kernels_cu/common.cuh static_asserts sizeof(BwdParams) == 68 * 8."""
    assert _launch.BWD_PARAMS_DTYPE.itemsize == 68 * 8
    names = _launch.BWD_PARAMS_DTYPE.names
    assert names[:12] == ("q", "k", "v", "o", "dout", "lse", "delta", "lse_acc", "dq_accum",
                          "dq", "dk", "dv")
    assert names[-4:] == ("scale_log2", "scale", "cu_q", "cu_k")
    src = (_compile.SOURCE_DIR / "common.cuh").read_text()
    body = src[src.index("struct BwdParams {"):src.index("static_assert(sizeof(BwdParams)")]
    fields = []
    for line in body.splitlines()[1:]:
        line = line.split("//")[0].strip().rstrip(";")
        if not line or line.startswith("}"):
            continue
        decl = line.replace("const ", "").replace("*", " ").split()
        fields += [f.strip(",") for f in decl[1:] if f.strip(",")] if decl[0] != "long" else \
            [f.strip(",") for f in decl[2:] if f.strip(",")]
    assert tuple(fields) == names


def test_mqa_launch(launches):
    """k, v: one head shared by 4 query heads; dk, dv sum over that axis inside a block."""
    B, H, S, D = 2, 4, 300, 64
    prob, (dq, dk, dv) = _bwd_problem((B, H), (B, 1), (B, 1), S, S, D, D)
    bp = _dispatch.bwd_generic_plan("float16", D, D, True)
    ws = FakeArray((_launch.backward_workspace_bytes(bp, prob),), 1 << 44, 1)
    _launch.launch_backward(bp, prob, dq, dk, dv, ws, ATTRS)
    names = [r[0] for r in launches]
    assert names == [bp.preprocess.spec.name, bp.passes[0][1].spec.name, bp.passes[1][1].spec.name]
    p = launches[0][3]
    assert (int(p["nb0"]), int(p["nb1"]), int(p["nb2"])) == (1, B, H)
    assert int(p["q_red"]) == 1 and int(p["kv_red"]) == 1 | 4  # axis 0 has size 1
    assert int(p["k_s2"]) == 0 and int(p["dk_s2"]) == 0 and int(p["dk_s1"]) == S * D
    assert int(p["delta"]) == 1 << 44 and int(p["lse_acc"]) == 0 and int(p["dq_accum"]) == 0
    assert int(p["lse_s2"]) == S and int(p["lse_sr"]) == 1
    bm, bn = bp.block_m, bp.block_n
    assert launches[0][1] == -(-S // 8) * B * H
    assert launches[1][1] == -(-S // bm) * B * H           # rows: every query head
    assert launches[2][1] == -(-S // bn) * B                # keys: one block row per key head
    assert int(p["n_mblocks"]) == -(-S // bm) and int(p["n_nblocks"]) == -(-S // bn)
    assert all(bytes(r[3]) == bytes(p) for r in launches)  # one parameter block for all


def test_q_broadcast_and_float64_workspace(launches):
    prob, (dq, dk, dv) = _bwd_problem((1, 3), (2, 3), (2, 3), 17, 40, 8, 8, "float64")
    bp = _dispatch.bwd_generic_plan("float64", 8, 8, False)
    assert bp.lse_acc
    need = _launch.backward_workspace_bytes(bp, prob)
    assert need == _launch._align(6 * 17 * 8) + _launch._align(2 * 6 * 17 * 8)  # delta; m, l
    ws = FakeArray((need,), 1 << 44, 1)
    _launch.launch_backward(bp, prob, dq, dk, dv, ws, ATTRS)
    p = launches[0][3]
    assert int(p["lse_acc"]) == (1 << 44) + _launch._align(6 * 17 * 8)
    assert int(p["q_red"]) & 2 and not int(p["kv_red"]) & 6
    assert launches[1][1] == -(-17 // bp.block_m) * 3       # rows: q owners = 3 heads


def test_workspace_checks(launches):
    prob, (dq, dk, dv) = _bwd_problem((2,), (2,), (2,), 10, 10, 8, 8)
    bp = _dispatch.bwd_generic_plan("float16", 8, 8, False)
    need = _launch.backward_workspace_bytes(bp, prob)
    with pytest.raises(ValueError, match="workspace has 16 bytes"):
        _launch.launch_backward(bp, prob, dq, dk, dv, FakeArray((16,), 1 << 44, 1), ATTRS)
    with pytest.raises(ValueError, match="256-byte boundary"):
        _launch.launch_backward(bp, prob, dq, dk, dv, FakeArray((need,), (1 << 44) + 16, 1),
                                ATTRS)
    assert not launches


def test_shared_memory_is_checked(launches):
    prob, (dq, dk, dv) = _bwd_problem((2,), (2,), (2,), 10, 10, 256, 256, "float64")
    bp = _dispatch.bwd_generic_plan("float64", 256, 256, False)
    ws = FakeArray((_launch.backward_workspace_bytes(bp, prob),), 1 << 44, 1)
    with pytest.raises(ValueError, match="bytes of shared memory per block"):
        _launch.launch_backward(bp, prob, dq, dk, dv, ws, dict(ATTRS, max_smem_optin=48 * 1024))


def test_backward_plans():
    plans = _dispatch.all_backward_specialisations(90)
    generic = [bp for bp in plans if bp.label.startswith("generic-bwd")]
    tc = [bp for bp in plans if bp.label.startswith("tensorcore-bwd") and "3xfp16" not in bp.label]
    tc32 = [bp for bp in plans if bp.label.startswith("tensorcore-bwd<float32,3xfp16,")]
    assert len(tc32) == len(_dispatch.TC_BWD_F16SPLIT_CONFIGS) * 2 * 2  # D, mask, determinism
    hopper = [bp for bp in plans if bp.label.startswith("hopper-bwd")]
    assert len(generic) == 4 * 4 * 2
    assert len(tc) == 2 * len(_dispatch.TC_BWD_CONFIGS) * 2 * 2  # dtypes, D, mask, determinism
    assert len(hopper) == 2 * len(_dispatch.HOPPER_BWD_CONFIGS) * 2 * 2
    assert not any(bp.label.startswith("hopper-bwd")
                   for bp in _dispatch.all_backward_specialisations(80))
    for bp in generic:
        assert bp.deterministic and bp.dq_accum_row == 0
        assert [g for g, _ in bp.passes] == ["rows", "keys"]
        for _, plan in bp.passes:
            assert plan.smem_bytes <= 163 * 1024, plan.label  # fits an A100 as well
            assert plan.threads in (64, 128)
    for cc, limit in ((80, 163 * 1024), (86, 99 * 1024), (90, 227 * 1024)):
        for dpad in _dispatch.TC_BWD_CONFIGS:
            bp = _dispatch.bwd_tensorcore_plan("float16", dpad, True, True, cc)
            assert [g for g, _ in bp.passes] == ["keys", "dq_convert"]
            assert bp.dq_accum_row == dpad + _dispatch.TC_BWD_DQ_PAD and not bp.lse_acc
            kern = bp.passes[0][1]
            assert kern.smem_bytes <= limit, (cc, kern.label)
            assert kern.threads <= 1024 and kern.block_n == kern.threads // 2
            assert "cuflash_bwd_mma<cuflash::fp16_t" in kern.spec.name
    prob = types.SimpleNamespace(kernel="hopper", dtype_name="float16", d=64, dv=64,
                                 causal=False, deterministic=False)
    assert _dispatch.backward_plan_for(prob, 90).label == \
        "hopper-bwd<float16,D64,BM128,BN128,full>"
    with pytest.raises(ValueError, match="kernel='hopper'.*compute capability 9.0"):
        _dispatch.backward_plan_for(prob, 80)
    prob.kernel = "auto"
    assert _dispatch.backward_plan_for(prob, 90).label == \
        "hopper-bwd<float16,D64,BM128,BN128,full>"  # _dispatch.HOPPER_BWD_AUTO
    assert _dispatch.backward_plan_for(prob, 80).label == \
        "tensorcore-bwd<float16,D64,BM64,BN128,lean,full>"
    assert _dispatch.backward_plan_for(prob, 75).label == "generic-bwd<float16,D64,full>"
    prob.deterministic = True
    bp = _dispatch.backward_plan_for(prob, 90)
    assert bp.deterministic and "det" in bp.label
    prob.kernel = "generic"
    assert _dispatch.backward_plan_for(prob, 90).label == "generic-bwd<float16,D64,full>"
    for edit, why in ((dict(dtype_name="float64"), "float16 and bfloat16"),
                      (dict(d=256, dv=256), "up to 128"), (dict(dv=32), "D == Dv"),
                      (dict(d=60, dv=60), "multiple of 8")):
        bad = types.SimpleNamespace(**dict(vars(prob), kernel="tensorcore", **edit))
        with pytest.raises(ValueError, match=why):
            _dispatch.backward_plan_for(bad, 90)
        bad.kernel = "auto"
        if edit.get("d") == 256:  # the Hopper backward takes D = 256 (and says no reason)
            assert _dispatch.backward_plan_for(bad, 90).label.startswith("hopper-bwd<float16,D256")
            assert _dispatch.backward_fallback_reason(bad, 90) is None
        cc = 80 if edit.get("d") == 256 else 90
        assert _dispatch.backward_plan_for(bad, cc).label.startswith("generic-bwd")
        assert why in _dispatch.backward_fallback_reason(bad, cc)
    specs = _dispatch.backward_kernel_specs(90)
    assert len(specs) == len(set(specs))
    assert any("cuflash_bwd_convert_dq" in s.name for s in specs)
    assert any("cuflash_bwd_mma" in s.name for s in specs)


def test_backward_candidate_plans():
    """The speed candidates (TC_BWD_CANDIDATES) make launchable plans on an H200, name their
    OPT bits in the label and the kernel name, keep the late hand-over for deterministic plans
    only, and leave the default tables as they were."""
    before = dict(_dispatch.TC_BWD_CONFIGS)
    plans = _dispatch.bwd_candidate_plans(90)
    assert _dispatch.TC_BWD_CONFIGS == before
    names = set()
    for bp in plans:
        kern = bp.passes[0][1]
        assert kern.smem_bytes <= 227 * 1024 and kern.threads <= 1024, kern.label
        assert kern.block_n == kern.threads // 2
        opt = int(kern.spec.name.rsplit(",", 1)[1].rstrip(">"))
        assert ("lean," in bp.label) == bool(opt & 1) and ("late," in bp.label) == bool(opt & 2)
        assert bp.deterministic or not opt & 2, bp.label
        names.add(kern.spec.name)
    assert len(names) == len(plans)
    for name, cand in _dispatch.TC_BWD_CANDIDATES.items():
        for dpad, cfg in cand.items():
            bm, nwarps, stages, _ = cfg[:4]
            assert _dispatch.bwd_tensorcore_smem(dpad, bm, nwarps, stages) <= 227 * 1024, name


# ---------------------------------------------------------------------------------------------
# The gradient section of cuflash-check

def _cli(*args):
    from click.testing import CliRunner

    from cuflash.cli import main

    return CliRunner().invoke(main, [str(a) for a in args])


def test_audit_has_a_gradient_section(tmp_path):
    from cuflash import _audit_grad

    path = tmp_path / "audit.json"
    r = _cli("--quick", "--device", "cpu", "--seed", 4, "--json", path)
    assert r.exit_code == 0, r.output
    assert "gradients (cuflash.attention_backward vs float64)" in r.output
    import json

    doc = json.loads(path.read_text())
    g = doc["gradients"]
    # every audited dtype (bfloat16 too where ml_dtypes is installed)
    assert len(g["cases"]) == len(_audit_grad.standard_grid(quick=True)) * len(doc["dtypes"])
    assert all(c["result"] == "PASS" for c in g["cases"])
    assert set(g["cases"][0]["err"]) == {"dq", "dk", "dv"}
    assert doc["summary"]["gradient_cases"] == len(g["cases"])


def test_audit_gradient_failure_is_reported(monkeypatch):
    """A backward that is wrong by a little more than the rule allows fails the audit."""
    from cuflash import _audit_grad

    real = _audit_grad.attention_backward

    def off(*args, **kwargs):
        dq, dk, dv = real(*args, **kwargs)
        dk[..., 0, 0] += 0.5
        return dq, dk, dv

    monkeypatch.setattr(_audit_grad, "attention_backward", off)
    r = _cli("--quick", "--device", "cpu", "--dtype", "float32")
    assert r.exit_code == 1, r.output
    assert "FAIL gradients float32" in r.output and "dk: max abs error" in r.output


def test_audit_npz_with_do(tmp_path):
    rng = np.random.default_rng(0)
    path = tmp_path / "qkv.npz"
    np.savez(path, q=rng.standard_normal((2, 5, 16)).astype(np.float32),
             k=rng.standard_normal((2, 9, 16)).astype(np.float32),
             v=rng.standard_normal((2, 9, 8)).astype(np.float32),
             do=rng.standard_normal((2, 5, 8)).astype(np.float32), causal=np.bool_(True))
    r = _cli(path, "--device", "cpu")
    assert r.exit_code == 0, r.output
    assert "gradients (cuflash.attention_backward" in r.output
    assert "(2,5,9,16,8)" in r.output
    np.savez(path, q=rng.standard_normal((2, 5, 16)).astype(np.float32),
             k=rng.standard_normal((2, 9, 16)).astype(np.float32),
             v=rng.standard_normal((2, 9, 8)).astype(np.float32))
    r = _cli(path, "--device", "cpu")
    assert r.exit_code == 0 and "gradients" not in r.output
    np.savez(path, q=np.ones((2, 5, 16), np.float32), k=np.ones((2, 9, 16), np.float32),
             v=np.ones((2, 9, 8), np.float32), do=np.ones((2, 5, 7), np.float32))
    r = _cli(path, "--device", "cpu")
    assert r.exit_code == 2 and "do has shape (2, 5, 7); expected (2, 5, 8)" in r.output


# ---------------------------------------------------------------------------------------------
# The benchmark's GPU twins of the reference gradients (run here with NumPy)

def _bench():
    import importlib.util

    path = _compile.SOURCE_DIR.parent / "benchmarks" / "bench.py"
    spec = importlib.util.spec_from_file_location("bench_for_tests", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_bench_gradient_twins_match_the_reference(dtype, causal):
    bench = _bench()
    rng = _rng("twins", dtype, causal)
    q, k, v, do = (x[0] for x in _problem(rng, dtype, (1,), (1,), (1,), 40, 40, 16, 16))
    scale = 0.25
    (dq, dk, dv), scales = bench.grad_reference_xp(np, q, k, v, do, causal, scale)
    want = ref.attention_backward_ref(do, q, k, v, causal=causal, scale=scale)
    for a, b in zip((dq, dk, dv), want):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-12)
    np.testing.assert_allclose(scales, ref.gradient_scales(do, q, k, v, causal=causal,
                                                           scale=scale), rtol=1e-12)
    naive = bench.grad_naive_xp(np, q, k, v, do, causal, scale, dtype)
    want = ref.naive_attention_backward(do, q, k, v, causal=causal, scale=scale, dtype=dtype)
    for a, b in zip(naive, want):
        # the same stages and roundings; float32 sums in another order may differ by an ulp of
        # a stage, which rounding to the dtype can turn into one ulp of the dtype
        u = ref.unit_roundoff(dtype)
        assert float(np.max(np.abs(a - b))) <= 4 * u * max(1.0, float(np.max(np.abs(b))))


def test_bench_backward_arguments():
    bench = _bench()
    args = bench.parse_args(["--pass", "backward"])
    assert args.pass_ == "backward" and args.impl == bench.BACKWARD_IMPLS
    assert args.s == bench.BACKWARD_DEFAULT_S
    args = bench.parse_args(["--pass", "backward", "--dtype", "float32"])
    assert args.impl == bench.BACKWARD_FLOAT32_IMPLS
    assert bench.parse_args([]).pass_ == "forward"


# ---------------------------------------------------------------------------------------------
# The generic GPU kernels' indexing, through a NumPy model (tests/bwd_generic_model.py) run on
# the parameter block launch_backward builds

MODEL_CASES = [  # (dtype, q batch, k batch, v batch, Sq, Sk, D, Dv, causal, layout)
    ("float16", (2, 4), (2, 1), (2, 1), 37, 50, 40, 24, True, "contiguous"),   # MQA, summed
    ("float32", (1, 3), (2, 3), (2, 3), 20, 33, 16, 16, False, "contiguous"),  # dq summed
    ("float64", (2, 3), (2, 3), (2, 3), 40, 9, 64, 64, True, "bshd"),   # rows without keys
    ("float64", (2,), (2,), (2,), 9, 45, 200, 136, True, "contiguous"),  # the WIDE config
    ("bfloat16", (3, 2), (3, 2), (3, 2), 33, 33, 64, 64, True, "bshd"),
    ("float16", (), (3,), (3,), 5, 70, 8, 8, False, "contiguous"),  # 2-D q, dq summed
]


def _model_inputs(rng, dtype, qb, kb, vb, sq, sk, d, dv, causal):
    """q, k, v, do (_problem), o rounded to dtype, lse rounded to float32, the exact lse, and the
    broadcast batch shape."""
    q, k, v, do = _problem(rng, dtype, qb, kb, vb, sq, sk, d, dv)
    o_ref, lse_ref = ref.attention_ref(q, k, v, causal=causal)
    o = ref.round_to(o_ref, dtype)
    lse = ref.round_to(lse_ref, "float32")
    return q, k, v, do, o, lse, lse_ref, tuple(np.broadcast_shapes(qb, kb, vb))


@pytest.mark.parametrize("dtype,qb,kb,vb,sq,sk,d,dv,causal,layout", MODEL_CASES)
def test_generic_kernels_model(dtype, qb, kb, vb, sq, sk, d, dv, causal, layout, monkeypatch):
    import bwd_generic_model as model

    rng = _rng("model", dtype, qb, kb, vb, sq, sk, d, dv, causal)
    q, k, v, do, o, lse, lse_ref, batch = _model_inputs(rng, dtype, qb, kb, vb, sq, sk, d, dv,
                                                        causal)
    item = 8 if dtype == "float64" else (4 if dtype == "float32" else 2)
    mem = model.Memory()

    def arr(x, itemsize=item):
        if layout == "bshd" and x.ndim == 4:  # (B, S, H, D) memory seen as (B, H, S, D)
            b, h, s_, c = x.shape
            return model.FakeArray(mem, x, itemsize, [s_ * h * c, c, h * c, 1])
        return model.FakeArray(mem, x, itemsize)

    fq, fk, fv, fo, fdo = (arr(x) for x in (q, k, v, o, do))
    # lse through a strided view (every other float32), as a slice of a wider buffer gives
    flse = model.FakeArray(mem, lse, 4, [int(np.prod(lse.shape[i + 1:])) * 2
                                         for i in range(lse.ndim - 1)] + [2])
    grads = [arr(np.zeros(x.shape)) for x in (q, k, v)]
    for g in grads:  # poison: unwritten elements stay NaN
        g.mem.write(g.data.ptr, np.arange(g.nbytes // item), np.full(g.nbytes // item, np.nan))
    prob = types.SimpleNamespace(q=fq, k=fk, v=fv, o=fo, do=fdo, lse=flse, batch_shape=batch,
                                 sq=sq, sk=sk, d=d, dv=dv, dtype_name=dtype, scale=d ** -0.5,
                                 stream=None, device_id=0, deterministic=True, causal=causal,
                                 kernel="generic")
    bp = _dispatch.bwd_generic_plan(dtype, d, dv, causal)
    launches = _record_launches(bp, prob, grads, mem, monkeypatch)
    model.run_plan_launches(mem, launches, causal, dtype)
    _check_model_grads(grads, do, q, k, v, causal, dtype, lse_ref,
                       lse_term=dtype not in ("float32", "float64"))


def _record_launches(bp, prob, grads, mem, monkeypatch):
    """launch_backward for plan bp on FakeArrays, with a workspace in mem; returns the launches
    (spec name, grid, threads, parameter block) instead of running them."""
    acc = 8 if prob.dtype_name == "float64" else 4
    ws_bytes = _launch.backward_workspace_bytes(bp, prob)
    ws = types.SimpleNamespace(nbytes=ws_bytes, data=types.SimpleNamespace(
        ptr=mem.alloc(ws_bytes // acc, acc)))
    assert ws.data.ptr % 256 == 0
    launches = []

    def get_kernel(spec, dev, smem=0):
        return lambda grid, block, args, shared_mem=0, stream=None: launches.append(
            (spec.name, grid[0], block[0], args[0]))

    monkeypatch.setattr(_compile, "get_kernel", get_kernel)
    monkeypatch.setattr(_launch, "_stream_ptr", lambda s: None)
    _launch.launch_backward(bp, prob, *grads, ws, ATTRS)
    return launches


def _check_model_grads(grads, do, q, k, v, causal, dtype, lse_ref, lse_term):
    """A model's gradients (float64 arithmetic) against the float64 reference: every element
    written, errors within the input roundings (o to dtype, lse to float32 when lse_term)."""
    g_ref = ref.attention_backward_ref(do, q, k, v, causal=causal)
    u = ref.unit_roundoff(dtype)
    lse_rel = 8 * 2.0 ** -24 * max(1.0, float(np.max(np.abs(lse_ref[np.isfinite(lse_ref)])))) \
        if lse_term else 0.0
    for name, g, r in zip(("dq", "dk", "dv"), grads, g_ref):
        got = g.values()
        assert not np.isnan(got).any(), f"{name}: {int(np.isnan(got).sum())} elements unwritten"
        scale_r = float(np.max(np.abs(r)))
        # the model's only errors: inputs o (rounded to dtype) and lse (float32) for 16-bit,
        # and one rounding of the output
        tol = (2 * u + lse_rel + 64 * 2.0 ** -53) * max(scale_r, 1.0) * 8
        err = float(np.max(np.abs(got - r)))
        assert err <= tol, f"{name}: model error {err:.3e} > {tol:.3e}"


# ---------------------------------------------------------------------------------------------
# The tensor-core backward's fragment layouts and indexing, through a lane-level NumPy model
# (tests/bwd_mma_model.py: ldmatrix / mma.sync fragment semantics, the kernel's shared-memory
# layout and addresses) run on the parameter block launch_backward builds

MMA_MODEL_CASES = [  # (dtype, q batch, k batch, Sq, Sk, D, causal, deterministic, cc, layout)
    ("float16", (2,), (2,), 70, 45, 64, True, False, 90, "contiguous"),   # tails, Sq != Sk
    ("bfloat16", (1, 3), (1, 1), 33, 100, 40, False, True, 90, "contiguous"),  # MQA, D padded
    ("float16", (2,), (2,), 130, 60, 64, True, True, 90, "bshd"),  # rows without keys, strided
    ("float16", (1,), (1,), 20, 150, 128, True, True, 90, "contiguous"),  # BN = 128, 8 warps
    ("bfloat16", (2,), (2,), 100, 70, 96, False, False, 86, "bshd"),  # one stage (sm_86 tiles)
    ("float16", (3,), (1,), 7, 1, 64, True, False, 80, "contiguous"),  # one key
]


# The speed candidates (_dispatch.TC_BWD_CANDIDATES) in place of the defaults: BN = 128 at D = 64
# (8 warps, a new dQ split), the OPT bits (lean bookkeeping, late hand-over).
MMA_MODEL_CANDIDATE_CASES = [  # (candidate, dtype, q batch, k batch, Sq, Sk, D, causal, det)
    ("w8+lean+late", "float16", (2,), (2,), 150, 200, 64, True, True),
    ("w8", "bfloat16", (1, 2), (1, 1), 70, 130, 48, False, False),
    ("lean+late", "float16", (2,), (2,), 90, 140, 64, False, True),
    ("lean+late", "bfloat16", (1,), (1,), 45, 150, 128, True, True),
]


@pytest.mark.parametrize("cand,dtype,qb,kb,sq,sk,d,causal,det", MMA_MODEL_CANDIDATE_CASES)
def test_tensorcore_kernel_model_candidates(cand, dtype, qb, kb, sq, sk, d, causal, det,
                                            monkeypatch):
    cfgs = {**_dispatch.TC_BWD_CONFIGS, **_dispatch.TC_BWD_CANDIDATES[cand]}
    monkeypatch.setattr(_dispatch, "TC_BWD_CONFIGS", cfgs)
    bm, nwarps, _, _, opt = _dispatch.bwd_tensorcore_config(
        _dispatch.head_dim_bucket(d, cfgs), 90)
    name = _dispatch.bwd_tensorcore_plan(dtype, d, causal, det, 90).passes[0][1].spec.name
    assert f", {bm}, {16 * nwarps}, {nwarps}," in name, name  # the candidate's tiles run
    assert name.endswith(f", {opt if det else opt & 1}>"), name  # and its OPT bits
    test_tensorcore_kernel_model(dtype, qb, kb, sq, sk, d, causal, det, 90, "contiguous",
                                 monkeypatch)


@pytest.mark.parametrize("dtype,qb,kb,sq,sk,d,causal,det,cc,layout", MMA_MODEL_CASES)
def test_tensorcore_kernel_model(dtype, qb, kb, sq, sk, d, causal, det, cc, layout, monkeypatch):
    _run_kernel_model("tensorcore", dtype, qb, kb, sq, sk, d, causal, det, cc, layout,
                      monkeypatch)


def _run_kernel_model(kernel, dtype, qb, kb, sq, sk, d, causal, det, cc, layout, monkeypatch,
                      **model_kw):
    """The plan backward_plan_for picks for kernel= ("tensorcore": tests/bwd_mma_model.py,
    "hopper": tests/bwd_wgmma_model.py) on FakeArrays, its recorded launches run by the model
    (model_kw: passed on to its run_plan_launches)."""
    import bwd_generic_model as gmodel
    import bwd_mma_model
    import bwd_wgmma_model

    model = {"tensorcore": bwd_mma_model, "hopper": bwd_wgmma_model}[kernel]
    rng = _rng(f"{'mma' if kernel == 'tensorcore' else kernel}-model", dtype, qb, kb, sq, sk, d,
               causal, det, cc)
    q, k, v, do, o, lse, lse_ref, batch = _model_inputs(rng, dtype, qb, kb, kb, sq, sk, d, d,
                                                        causal)
    mem = gmodel.Memory()

    def arr(x, itemsize=2):
        if layout == "bshd" and x.ndim == 3:  # (S, H, D) memory seen as (H, S, D)
            h, s_, c = x.shape
            return gmodel.FakeArray(mem, x, itemsize, [c, h * c, 1])
        return gmodel.FakeArray(mem, x, itemsize)

    fq, fk, fv, fo, fdo = (arr(x) for x in (q, k, v, o, do))
    flse = gmodel.FakeArray(mem, lse, 4)
    grads = [arr(np.zeros(x.shape)) for x in (q, k, v)]
    for g in grads:  # poison: unwritten elements stay NaN
        g.mem.write(g.data.ptr, np.arange(g.nbytes // 2), np.full(g.nbytes // 2, np.nan))

    prob = types.SimpleNamespace(q=fq, k=fk, v=fv, o=fo, do=fdo, lse=flse, batch_shape=batch,
                                 sq=sq, sk=sk, d=d, dv=d, dtype_name=dtype, scale=d ** -0.5,
                                 stream=None, device_id=0, deterministic=det, causal=causal,
                                 kernel=kernel, backend="gpu", out_grads=None)
    monkeypatch.setattr(_dispatch, "_aligned16", lambda x: True)  # FakeArrays: no real pointers
    bp = _dispatch.backward_plan_for(prob, cc)
    assert bp.label.startswith(f"{kernel}-bwd") and bp.deterministic == det
    launches = _record_launches(bp, prob, grads, mem, monkeypatch)
    model.run_plan_launches(mem, launches, bp, causal, **model_kw)
    _check_model_grads(grads, do, q, k, v, causal, dtype, lse_ref, lse_term=True)


def test_tensorcore_model_catches_a_layout_error(monkeypatch):
    """The model is sharp: swapping two ldmatrix matrices of the dS^T read (a plausible slip)
    gives a wrong dq."""
    import bwd_mma_model as model

    real = model._lane_offsets

    def swapped(c):
        a_rows, b_rows, b_trans, a_trans_ds = real(c)
        lr, lm = model.LANE % 8, model.LANE // 8
        wrong = ((lr + 8 * (lm % 2)) * c.sds + 8 * (lm // 2)) * 2
        return a_rows, b_rows, b_trans, wrong

    monkeypatch.setattr(model, "_lane_offsets", swapped)
    with pytest.raises(AssertionError, match="dq: model error"):
        test_tensorcore_kernel_model("float16", (1,), (1,), 40, 40, 64, False, False, 90,
                                     "contiguous", monkeypatch)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_dq_accum_row_bound_covers_every_plan(dtype):
    """`_dispatch.backward_dq_accum_row_bound` (what cuflash.jax sizes its XLA workspace with at
    trace time) is at least the dq accumulator row of every plain backward plan the dispatcher
    can build for the dtype and head dim, on every architecture: the GPU run of 2026-12-02 found
    the float32 tensor-core plan (and the Hopper plan's D = 256) outside the earlier bound."""
    plans = 0
    for d in range(1, 257):
        bound = _dispatch.backward_dq_accum_row_bound(dtype, d)
        builders = [lambda c, det: _dispatch.bwd_generic_plan(dtype, d, d, c)]
        if dtype in ("float16", "bfloat16"):
            builders += [
                lambda c, det: _dispatch.bwd_hopper_plan(dtype, d, c, det),
                *[(lambda c, det, cc=cc: _dispatch.bwd_tensorcore_plan(dtype, d, c, det, cc))
                  for cc in (80, 86, 89, 90)]]
        if dtype == "float32":
            builders += [(lambda c, det, cc=cc: _dispatch.bwd_tensorcore_f32_plan(d, c, det, cc))
                         for cc in (80, 86, 89, 90)]
        for build in builders:
            for causal in (False, True):
                for det in (False, True):
                    try:
                        plan = build(causal, det)
                    except ValueError:  # a head dim this backward does not take
                        continue
                    plans += 1
                    assert plan.dq_accum_row <= bound, (dtype, d, plan.label, bound)
    assert plans > 0
