"""attention_varlen_backward on the CPU (NumPy path): against the float64 reference per sequence
under the gradient pass rule, finite differences, ragged and empty sequences, Sq != Sk, causal,
grouped heads, strided views, NaN-poisoned outputs, the argument checks, and the GPU path's
host-side plan and parameter block (no GPU needed)."""
import numpy as np
import pytest

import cuflash
from cuflash import _dispatch, _varlen_backward, reference

from seeds import SEED, case_rng
from varlen_util import check_varlen_grads, make_varlen

# Ragged lengths with 1 and 0 on either side and Sq != Sk per sequence.
LENS = [([5, 1, 0, 7, 3], [6, 3, 4, 1, 0]), ([1], [1]), ([2, 9], [9, 2])]
HEADS = [(4, 4), (4, 2), (6, 1)]


def _rng(*key):
    return case_rng(SEED, "varlen_backward_cpu", *key)


def _as(x, dtype):
    if dtype == "bfloat16":
        import ml_dtypes

        return np.asarray(x).astype(ml_dtypes.bfloat16)
    return np.asarray(x).astype(dtype)


def _forward_and_do(rng, q, k, v, cu_q, cu_k, causal, dtype):
    """The dtype's arrays, o and lse from cuflash.attention_varlen, and a random do."""
    cast = [_as(x, dtype) for x in (q, k, v)]
    mq = max(1, int(np.diff(cu_q).max()))
    mk = max(1, int(np.diff(cu_k).max()))
    o, lse = cuflash.attention_varlen(*cast, cu_q, cu_k, mq, mk, causal=causal, return_lse=True)
    do = reference.round_to(rng.standard_normal(o.shape), dtype)
    return cast, o, lse, do, mq, mk


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"H{h[0]}kv{h[1]}")
@pytest.mark.parametrize("lens", LENS, ids=lambda x: "q" + "-".join(map(str, x[0])))
def test_matches_reference(lens, heads, causal, dtype):
    rng = _rng("ref", dtype, causal, heads, len(lens[0]))
    h, hkv = heads
    q, k, v, cu_q, cu_k = make_varlen(rng, *lens, h, hkv, 8, dtype)
    (qc, kc, vc), o, lse, do, mq, mk = _forward_and_do(rng, q, k, v, cu_q, cu_k, causal, dtype)
    grads = cuflash.attention_varlen_backward(_as(do, dtype), qc, kc, vc, o, lse,
                                              cu_q, cu_k, mq, mk, causal=causal)
    for g, x in zip(grads, (qc, kc, vc)):
        assert g.shape == x.shape and g.dtype == x.dtype
    check_varlen_grads(grads, do, q, k, v, cu_q, cu_k, causal=causal, dtype=dtype)


@pytest.mark.parametrize("causal", [False, True])
def test_finite_differences(causal):
    """float64: the gradient of L = sum(do * o) against central differences of the float64
    varlen forward, every element of q, k and v of a tiny ragged GQA batch."""
    rng = _rng("fd", causal)
    q, k, v, cu_q, cu_k = make_varlen(rng, [3, 1, 0, 2], [2, 3, 1, 0], 2, 1, 3, "float64")
    o, lse = cuflash.attention_varlen(q, k, v, cu_q, cu_k, 3, 3, causal=causal, return_lse=True)
    do = rng.standard_normal(o.shape)
    grads = cuflash.attention_varlen_backward(do, q, k, v, o, lse, cu_q, cu_k, 3, 3,
                                              causal=causal)

    def loss(qq, kk, vv):
        return float(np.sum(do * reference.attention_varlen_ref(qq, kk, vv, cu_q, cu_k,
                                                                causal=causal)[0]))

    eps = 1e-6
    for i, (x, g) in enumerate(zip((q, k, v), grads)):
        fd = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            args = [q.copy(), k.copy(), v.copy()]
            args[i][idx] += eps
            up = loss(*args)
            args[i][idx] -= 2 * eps
            fd[idx] = (up - loss(*args)) / (2 * eps)
        np.testing.assert_allclose(g, fd, atol=1e-7, rtol=1e-6)
    assert np.any(grads[0] != 0) and np.any(grads[1] != 0) and np.any(grads[2] != 0)


def test_reference_is_the_dense_backward_per_sequence():
    """attention_varlen_backward_ref of one sequence equals attention_backward_ref on it, and
    a sequence's gradients do not depend on its neighbours."""
    rng = _rng("refdense")
    q, k, v, cu_q, cu_k = make_varlen(rng, [4, 3], [5, 2], 4, 2, 8, "float64")
    do = rng.standard_normal(q.shape)
    dq, dk, dv = reference.attention_varlen_backward_ref(do, q, k, v, cu_q, cu_k, causal=True)
    t = lambda x: x.transpose(1, 0, 2)  # noqa: E731
    want = reference.attention_backward_ref(t(do[4:]), t(q[4:]), t(k[5:]), t(v[5:]),
                                            causal=True)
    for got, w in zip((dq[4:], dk[5:], dv[5:]), want):
        np.testing.assert_allclose(t(got), w, rtol=1e-12, atol=1e-12)


def test_strided_views_and_poisoned_out():
    """Non-contiguous q, k, v, do, o and lse views give the contiguous inputs' results, into
    NaN-poisoned out= buffers (every element written; rows of no sequence 0)."""
    rng = _rng("strided")
    h, hkv, d = 4, 2, 8
    lens_q, lens_k = [3, 0, 5, 1], [2, 4, 5, 0]
    q, k, v, cu_q, cu_k = make_varlen(rng, lens_q, lens_k, h, hkv, d, "float32")
    q, k, v = (x.astype(np.float32) for x in (q, k, v))
    pad = lambda x: np.concatenate([x, np.ones((2,) + x.shape[1:], x.dtype)])  # noqa: E731
    qp = pad(q)  # two trailing rows that belong to no sequence
    o, lse = cuflash.attention_varlen(qp, k, v, cu_q, cu_k, 5, 5, return_lse=True)
    do = rng.standard_normal(o.shape).astype(np.float32)

    def view(x):  # same values, every axis strided
        big = np.full((x.shape[0], x.shape[1] * 2, x.shape[2] + 3), np.nan, x.dtype)
        big[:, ::2, 1:1 + x.shape[2]] = x
        return big[:, ::2, 1:1 + x.shape[2]]

    lse_v = np.full((lse.shape[1], lse.shape[0]), np.nan, np.float32).T
    lse_v[...] = lse
    want = cuflash.attention_varlen_backward(do, qp, k, v, o, lse, cu_q, cu_k, 5, 5)
    out = tuple(np.full(x.shape, np.nan, np.float32) for x in (qp, k, v))
    got = cuflash.attention_varlen_backward(view(do), view(qp), view(k), view(v), view(o), lse_v,
                                            cu_q, cu_k, 5, 5, out=out)
    assert all(g is b for g, b in zip(got, out))
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    assert np.all(got[0][-2:] == 0)
    check_varlen_grads(got, do.astype(np.float64), qp.astype(np.float64), k, v, cu_q, cu_k,
                       causal=False, dtype="float32")


def test_rows_that_see_no_key_get_zero_never_nan():
    """Causal with Sq > Sk: the first Sq - Sk rows of a sequence see no key (lse = -inf); their
    dq is 0 even with NaN in their q and do."""
    rng = _rng("nokey")
    q, k, v, cu_q, cu_k = make_varlen(rng, [6, 4], [2, 4], 2, 2, 8, "float64")
    o, lse = cuflash.attention_varlen(q, k, v, cu_q, cu_k, 6, 4, causal=True, return_lse=True)
    assert np.all(np.isneginf(lse[:, :4]))
    do = rng.standard_normal(o.shape)
    q[:4], do[:4] = np.nan, np.nan
    dq, dk, dv = cuflash.attention_varlen_backward(do, q, k, v, o, lse, cu_q, cu_k, 6, 4,
                                                   causal=True)
    assert np.all(dq[:4] == 0) and not np.isnan(dq).any()
    assert not np.isnan(dk).any() and not np.isnan(dv).any()


def test_deterministic_and_sizes():
    rng = _rng("det")
    q, k, v, cu_q, cu_k = make_varlen(rng, [3, 2], [2, 5], 2, 1, 8, "float32")
    q, k, v = (x.astype(np.float32) for x in (q, k, v))
    o, lse = cuflash.attention_varlen(q, k, v, cu_q, cu_k, 3, 5, return_lse=True)
    do = np.ones_like(o)
    a = cuflash.attention_varlen_backward(do, q, k, v, o, lse, cu_q, cu_k, 3, 5,
                                          deterministic=True)
    b = cuflash.attention_varlen_backward(do, q, k, v, o, lse, cu_q, cu_k, 3, 5)
    for x, y in zip(a, b):
        assert np.array_equal(x, y)
    args = (do, q, k, v, o, lse, cu_q, cu_k, 3, 5)
    assert cuflash.attention_varlen_backward_workspace_size(*args) == 0
    assert cuflash.varlen_backward_dispatch_info(*args) == "cpu-numpy"


def _args(dtype="float32"):
    rng = _rng("args")
    q, k, v, cu_q, cu_k = make_varlen(rng, [3, 2], [2, 4], 4, 2, 8, dtype)
    q, k, v = (x.astype(dtype) for x in (q, k, v))
    o, lse = cuflash.attention_varlen(q, k, v, cu_q, cu_k, 3, 4, return_lse=True)
    return dict(do=np.ones_like(o), q=q, k=k, v=v, o=o, lse=lse, cu_seqlens_q=cu_q,
                cu_seqlens_k=cu_k, max_seqlen_q=3, max_seqlen_k=4)


@pytest.mark.parametrize("change, exc, words", [
    (dict(lse=np.zeros((5, 4), np.float32)), ValueError, "lse has shape"),
    (dict(lse=np.zeros((4, 5), np.float64)), TypeError, "lse has dtype"),
    (dict(o=np.zeros((5, 4, 7), np.float32)), ValueError, "o has shape"),
    (dict(do=np.zeros((5, 4, 8), np.float64)), TypeError, "do has dtype"),
    (dict(deterministic=1), TypeError, "deterministic must be a bool"),
    (dict(causal="yes"), TypeError, "causal must be a bool"),
    (dict(kernel="hopper"), ValueError, "kernel must be one of"),
    (dict(kernel="tensorcore"), ValueError, "selects a GPU kernel"),
    (dict(stream=1), ValueError, "stream= applies to GPU inputs only"),
    (dict(out=(np.zeros((5, 4, 8), np.float32),)), ValueError, "out must be a tuple"),
    (dict(out=(np.zeros((5, 4, 8), np.float32), np.zeros((6, 2, 8), np.float32),
               np.zeros((5, 2, 8), np.float32))), ValueError, "out[2] (dv) has shape"),
    (dict(cu_seqlens_q=np.array([0, 3, 2], np.int32)), ValueError, "cu_seqlens_q must start"),
    (dict(cu_seqlens_k=np.array([0, 2, 6], np.int64)), TypeError, "cu_seqlens_k has dtype"),
    (dict(max_seqlen_q=2), ValueError, "more than max_seqlen"),
    (dict(q=np.ones((5, 3, 8), np.float32)), ValueError, "heads"),
    (dict(scale=float("nan")), ValueError, "scale"),
])
def test_argument_errors(change, exc, words):
    kw = _args()
    kw.update(change)
    with pytest.raises(exc, match=None) as info:
        cuflash.attention_varlen_backward(**kw)
    assert words in str(info.value), str(info.value)


def test_o_of_another_device_type_is_refused():
    kw = _args()
    kw["o"] = kw["o"].tolist()
    with pytest.raises((TypeError, ValueError)):
        cuflash.attention_varlen_backward(**kw)


# ---------------------------------------------------------------------------------------------
# The GPU path's host side, without a GPU: plans, kernel names, the parameter block, the grids.

class _Fake:
    """Stands for a CuPy array in the parameter-block builder (data.ptr, shape, strides)."""

    def __init__(self, x, ptr):
        self.shape, self.strides, self.itemsize = x.shape, x.strides, x.itemsize
        self.data = type("D", (), {"ptr": ptr})()


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_varlen_plans_are_the_dense_plans_with_varlen_kernels(dtype):
    dense = [_dispatch.bwd_generic_plan(dtype, 64, 64, True)]
    if dtype == "float16":
        dense.append(_dispatch.bwd_tensorcore_plan(dtype, 64, True, True, 90))
    for bp in dense:
        vp = _dispatch.varlen_backward_plan(bp)
        assert vp.label == "varlen-" + bp.label
        assert (vp.dq_accum_row, vp.deterministic, vp.lse_acc) == \
            (bp.dq_accum_row, bp.deterministic, bp.lse_acc)
        for (g0, p0), (g1, p1) in zip(((None, bp.preprocess),) + bp.passes,
                                      ((None, vp.preprocess),) + vp.passes):
            assert g0 == g1 and p1.spec.family == p0.spec.family
            head, _, targs = p0.spec.name.partition("<")
            assert p1.spec.name == f"{head}_varlen<{targs}"
            assert (p1.block_m, p1.block_n, p1.threads, p1.smem_bytes) == \
                (p0.block_m, p0.block_n, p0.threads, p0.smem_bytes)
        for p in (vp.preprocess,) + tuple(p for _, p in vp.passes):
            assert p.spec in _dispatch.varlen_backward_kernel_specs(90)


def test_segment_view_size_is_the_struct():
    from cuflash import _launch

    assert _varlen_backward.SEGMENT_VIEW_BYTES == _launch.BWD_PARAMS_DTYPE.itemsize


def test_parameter_block_and_grids():
    """The BwdParams of a packed GQA batch: batch (B, Hkv, G), batch stride 0 on the sequence
    axis, per-head strides, lse (H, total_q) strides, the dq accumulator (H, total_q, row),
    sq/sk = max_seqlen, the grids of max_seqlen blocks per sequence and head."""
    from cuflash import _launch

    h, hkv, d, nseq, total_q, total_k = 8, 2, 64, 3, 40, 50
    q = _Fake(np.empty((total_q, h, d), np.float16), 1 << 20)
    k = _Fake(np.empty((total_k, hkv, d), np.float16), 2 << 20)
    lse = _Fake(np.empty((h, total_q), np.float32), 3 << 20)
    cu = _Fake(np.empty(nseq + 1, np.int32), 4 << 20)
    prob = _varlen_backward.VarlenBackwardProblem(
        "gpu", 0, q, k, k, cu, cu, 17, 23, "float16", nseq, h, hkv, d, d, causal=True,
        scale=0.125, return_lse=False, out=None, out_lse=None, stream=None, kernel="auto",
        o=q, do=q, lse=lse, deterministic=True)
    bplan = _dispatch.varlen_backward_plan(_dispatch.bwd_tensorcore_plan("float16", d, True,
                                                                         True, 90))
    base = 5 << 20
    p, launches = _varlen_backward.varlen_backward_params(bplan, prob, q, k, k, base)
    g = h // hkv
    assert (p["nb0"], p["nb1"], p["nb2"]) == (nseq, hkv, g)
    assert (p["sq"], p["sk"], p["q_red"], p["kv_red"]) == (17, 23, 0, 4)
    assert (p["q_s0"], p["q_s1"], p["q_s2"], p["q_sr"]) == (0, g * d, d, h * d)
    assert (p["k_s0"], p["k_s1"], p["k_s2"], p["k_sr"]) == (0, d, 0, hkv * d)
    assert (p["lse_s0"], p["lse_s1"], p["lse_s2"], p["lse_sr"]) == (0, g * total_q, total_q, 1)
    row = bplan.dq_accum_row
    assert (p["dqa_s1"], p["dqa_s2"], p["dqa_sr"]) == (g * total_q * row, total_q * row, row)
    assert p["delta"] == base and p["lse_acc"] == 0
    assert p["dq_accum"] == base + _launch._align(h * total_q * 4)
    assert p["cu_q"] == cu.data.ptr and p["deterministic"] == 1
    need = _launch.backward_workspace_bytes(bplan, prob)
    assert need == _launch._align(h * total_q * 4) + _launch._align(h * total_q * row * 4)
    bm, bn = bplan.block_m, bplan.block_n
    assert [grid for _, grid in launches] == [
        -(-17 // 8) * nseq * h, -(-23 // bn) * nseq * hkv, -(-17 // 8) * nseq * h]
    assert p["n_mblocks"] == -(-17 // bm) and p["n_nblocks"] == -(-23 // bn)


def _segment_view(p, s, cu_q, cu_k, item, acc):
    """A transcription of kernels_cu/common.cuh: bwd_varlen_segment for sequence s (what every
    block of s runs its body on), on the model's byte addresses."""
    v = np.zeros((), dtype=p.dtype)   # a copy (np.array of a record may share its memory)
    v[()] = p
    q0, k0 = int(cu_q[s]), int(cu_k[s])
    heads = int(p["nb1"]) * int(p["nb2"])
    v["sq"], v["sk"], v["nb0"] = int(cu_q[s + 1]) - q0, int(cu_k[s + 1]) - k0, 1
    for name, sr in (("q", "q_sr"), ("o", "o_sr"), ("dout", "do_sr"), ("dq", "dq_sr")):
        v[name] = int(p[name]) + q0 * int(p[sr]) * item
    v["lse"] = int(p["lse"]) + q0 * int(p["lse_sr"]) * 4
    for name in ("k", "v", "dk", "dv"):
        v[name] = int(p[name]) + k0 * int(p[f"{name}_sr"]) * item
    v["delta"] = int(p["delta"]) + heads * q0 * acc
    if int(p["lse_acc"]):
        v["lse_acc"] = int(p["lse_acc"]) + 2 * heads * q0 * acc
    if int(p["dq_accum"]):
        v["dq_accum"] = int(p["dq_accum"]) + q0 * int(p["dqa_sr"]) * 4
    return v


@pytest.mark.parametrize("dtype,heads,causal", [("float16", (4, 2), True),
                                                ("float32", (3, 3), False),
                                                ("float64", (4, 1), True)])
def test_generic_kernels_model_on_the_varlen_parameter_block(dtype, heads, causal):
    """The generic backward's NumPy kernel model (tests/bwd_generic_model.py: block decoding,
    bwd_index/bwd_offsets, tiles, masks, stores, bounds-checked memory) run on the parameter
    block `varlen_backward_params` builds, through the segment view of each sequence, over the
    grids of max_seqlen with upper bounds: every sequence's gradients pass the rule, nothing is
    read or written outside its buffers (the workspace sections of delta and m, l included), and
    dq, dk, dv poisoned with NaN are fully written."""
    import bwd_generic_model as model

    h, hkv = heads
    d = 24
    lens_q, lens_k = [37, 1, 0, 20], [5, 40, 3, 0]
    rng = _rng("model", dtype, heads, causal)
    q, k, v, cu_q, cu_k = make_varlen(rng, lens_q, lens_k, h, hkv, d, dtype)
    o_ref, lse_ref = reference.attention_varlen_ref(q, k, v, cu_q, cu_k, causal=causal)
    o, lse = reference.round_to(o_ref, dtype), reference.round_to(lse_ref, "float32")
    do = reference.round_to(rng.standard_normal(o.shape), dtype)
    item = {"float16": 2, "float32": 4, "float64": 8}[dtype]
    acc = 8 if dtype == "float64" else 4
    mem = model.Memory()
    fq, fk, fv, fo, fdo = (model.FakeArray(mem, x, item) for x in (q, k, v, o, do))
    flse = model.FakeArray(mem, lse, 4)
    grads = [model.FakeArray(mem, np.full(x.shape, np.nan), item) for x in (q, k, v)]
    fcu = model.FakeArray(mem, cu_q, 4)
    max_q, max_k = max(lens_q) + 3, max(lens_k) + 5    # upper bounds
    prob = _varlen_backward.VarlenBackwardProblem(
        "gpu", 0, fq, fk, fv, fcu, fcu, max_q, max_k, dtype, len(lens_q), h, hkv, d, d,
        causal=causal, scale=d ** -0.5, return_lse=False, out=None, out_lse=None, stream=None,
        kernel="generic", o=fo, do=fdo, lse=flse, deterministic=False)
    bplan = _varlen_backward.varlen_backward_plan_for(prob, 90)
    assert bplan.label.startswith("varlen-generic-bwd")
    from cuflash import _launch

    ws = model.FakeArray(mem, np.full(_launch.backward_workspace_bytes(bplan, prob) // acc,
                                      np.nan), acc)
    p, launches = _varlen_backward.varlen_backward_params(bplan, prob, *grads, ws.data.ptr)
    nwarps, rows = _dispatch.bwd_generic_config(dtype, 32, 32)
    block = nwarps * rows
    assert [g for _, g in launches] == [-(-max_q // 8) * 4 * h, -(-max_q // block) * 4 * h,
                                        -(-max_k // block) * 4 * hkv]
    g = h // hkv
    for s in range(len(lens_q)):
        view = _segment_view(p, s, cu_q, cu_k, item, acc)
        sq_s = int(view["sq"])
        if sq_s:
            model.preprocess(mem, view, h * -(-sq_s // 8))
    for s in range(len(lens_q)):    # the "rows" pass, then the "keys" pass, as launched
        view = _segment_view(p, s, cu_q, cu_k, item, acc)
        model.dq_pass(mem, view, h * int(p["n_mblocks"]), block, causal, dtype)
    for s in range(len(lens_q)):
        view = _segment_view(p, s, cu_q, cu_k, item, acc)
        model.dkdv_pass(mem, view, hkv * int(p["n_nblocks"]), block, causal, dtype)
    assert (int(p["nb1"]), int(p["nb2"])) == (hkv, g)
    got = [reference.round_to(x.values(), dtype) for x in grads]
    check_varlen_grads(got, do, q, k, v, cu_q, cu_k, causal=causal, dtype=dtype)


@pytest.mark.parametrize("dtype,d,causal,det", [("float16", 64, True, True),
                                                ("bfloat16", 40, False, True),
                                                ("float16", 128, True, False)])
def test_tensorcore_kernel_model_on_the_varlen_parameter_block(dtype, d, causal, det):
    """The tensor-core backward's lane-level model (tests/bwd_mma_model.py: fragments, shared
    memory, masks, the dq accumulator and, with det, the turn counters, blocks in dispatch
    order) on each sequence's segment view of the varlen parameter block. The key blocks past a
    sequence leave in cuflash_bwd_mma_varlen; here the view's n_nblocks is the sequence's own
    count, which leaves the surviving blocks' numbering and order as they are."""
    import bwd_generic_model as gmodel
    import bwd_mma_model as model

    from cuflash import _launch

    h, hkv = 4, 2
    lens_q, lens_k = [37, 1, 0, 70], [50, 3, 9, 0]
    rng = _rng("mma-model", dtype, d, causal, det)
    q, k, v, cu_q, cu_k = make_varlen(rng, lens_q, lens_k, h, hkv, d, dtype)
    o_ref, lse_ref = reference.attention_varlen_ref(q, k, v, cu_q, cu_k, causal=causal)
    o, lse = reference.round_to(o_ref, dtype), reference.round_to(lse_ref, "float32")
    do = reference.round_to(rng.standard_normal(o.shape), dtype)
    mem = gmodel.Memory()
    fq, fk, fv, fo, fdo = (gmodel.FakeArray(mem, x, 2) for x in (q, k, v, o, do))
    flse = gmodel.FakeArray(mem, lse, 4)
    grads = [gmodel.FakeArray(mem, np.full(x.shape, np.nan), 2) for x in (q, k, v)]
    fcu = gmodel.FakeArray(mem, cu_q, 4)
    max_q, max_k = max(lens_q) + 1, max(lens_k) + 9
    prob = _varlen_backward.VarlenBackwardProblem(
        "gpu", 0, fq, fk, fv, fcu, fcu, max_q, max_k, dtype, len(lens_q), h, hkv, d, d,
        causal=causal, scale=d ** -0.5, return_lse=False, out=None, out_lse=None, stream=None,
        kernel="tensorcore", o=fo, do=fdo, lse=flse, deterministic=det)
    bplan = _dispatch.varlen_backward_plan(_dispatch.bwd_tensorcore_plan(dtype, d, causal, det,
                                                                         90))
    ws = gmodel.FakeArray(mem, np.full(_launch.backward_workspace_bytes(bplan, prob) // 4,
                                       np.nan), 4)
    p, _ = _varlen_backward.varlen_backward_params(bplan, prob, *grads, ws.data.ptr)
    name = bplan.passes[0][1].spec.name
    targs = [int(x) for x in name[name.index("<") + 1:name.rindex(">")].split(",")[1:6]]
    c = model.Cfg(*targs)
    views = [_segment_view(p, s, cu_q, cu_k, 2, 4) for s in range(len(lens_q))]
    for view in views:
        gmodel.preprocess(mem, view, h * -(-int(view["sq"]) // 8))
    for view in views:
        nn_s = -(-int(view["sk"]) // c.bn)
        view["n_nblocks"] = nn_s
        model.bwd_mma_kernel(mem, view, hkv * nn_s, c, causal, det)
    for view in views:
        model.convert_dq(mem, view, h * -(-int(view["sq"]) // 8))
    got = [reference.round_to(x.values(), dtype) for x in grads]
    check_varlen_grads(got, do, q, k, v, cu_q, cu_k, causal=causal, dtype=dtype)
