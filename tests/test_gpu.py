"""GPU tests: every kernel against the float64 SciPy reference, on fresh random inputs, with the
output buffers poisoned with NaN so an unwritten element fails. Skipped without a GPU."""
import math

import numpy as np
import pytest

import cuflash
from cuflash import reference

from conftest import HOPPER_SCHEDULES, hopper_schedule_table

from gpu_util import (bf16_dtype, check_against_reference, cupy, poisoned, random_inputs,
                      reference_result, to_gpu, to_host64)

pytestmark = pytest.mark.gpu

DTYPES = ["float16", "bfloat16", "float32", "float64"]
SHAPES = [(1, 1), (7, 7), (113, 113), (1000, 1000), (1, 1000), (1000, 7), (113, 1000), (257, 64),
          (64, 257), (300, 2048)]
from seeds import SEED, case_rng  # noqa: E402  (fresh every run; see pytest's header)


def _rng(*key):
    return case_rng(SEED, *key)


def _skip_unsupported(dtype):
    if dtype == "bfloat16" and bf16_dtype() is None:
        pytest.skip("bfloat16 on the GPU needs ml_dtypes (CuPy's bfloat16 dtype)")


def _run(q, k, v, dtype, *, causal, scale=None, kernel="auto", batch=None):
    cp = cupy()
    qg, kg, vg = to_gpu(q, dtype), to_gpu(k, dtype), to_gpu(v, dtype)
    batch = np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    o = poisoned(batch + (q.shape[-2], v.shape[-1]), dtype)
    lse = poisoned(batch + (q.shape[-2],), "float32")
    label = cuflash.dispatch_info(qg, kg, vg, causal=causal, kernel=kernel)
    res = cuflash.attention(qg, kg, vg, causal=causal, scale=scale, return_lse=True,
                            out=(o, lse), kernel=kernel)
    assert res[0] is o and res[1] is lse
    cp.cuda.get_current_stream().synchronize()
    return o, lse, label


@pytest.mark.parametrize("kernel", ["auto", "generic"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sq,sk", SHAPES)
def test_matches_reference(sq, sk, dtype, causal, kernel):
    _skip_unsupported(dtype)
    d = [64, 128, 256, 96][(sq + sk) % 4]
    batch = (2, 3) if max(sq, sk) < 1000 else (1, 2)
    rng = _rng("ref", sq, sk, dtype, causal, kernel)
    q, k, v = random_inputs(rng, batch, batch, sq, sk, d, d, dtype)
    o, lse, label = _run(q, k, v, dtype, causal=causal, kernel=kernel)
    if kernel == "auto" and dtype in ("float16", "bfloat16"):
        # the fast path is what these tests exercise
        assert label.startswith(("tensorcore", "hopper", "decode")), label
    check_against_reference(o, lse, q, k, v, causal=causal, scale=1 / math.sqrt(d), dtype=dtype)


def _fast_kernels():
    """The 16-bit kernels this GPU runs: the mma.sync kernel from sm_80, the Hopper one on 9.0."""
    if not cuflash.gpu_available():
        return ["tensorcore", "hopper"]  # skipped anyway
    cc = int(cupy().cuda.Device().compute_capability)
    return (["tensorcore"] if cc >= 80 else []) + (["hopper"] if cc == 90 else [])


@pytest.mark.parametrize("kernel", ["tensorcore", "hopper"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("sq,sk", SHAPES)
def test_fast_kernels_match_reference(sq, sk, dtype, causal, kernel):
    """Each 16-bit kernel forced explicitly (auto picks only one of them per device)."""
    _skip_unsupported(dtype)
    if kernel not in _fast_kernels():
        pytest.skip(f"kernel={kernel!r} does not run on this GPU")
    d = [128, 64, 96, 256][(sq + sk) % 4]
    batch = (2, 3) if max(sq, sk) < 1000 else (1, 2)
    rng = _rng("fast", sq, sk, dtype, causal, kernel)
    q, k, v = random_inputs(rng, batch, batch, sq, sk, d, d, dtype)
    o, lse, label = _run(q, k, v, dtype, causal=causal, kernel=kernel)
    assert label.startswith(kernel), label
    check_against_reference(o, lse, q, k, v, causal=causal, scale=1 / math.sqrt(d), dtype=dtype)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk,d", [(4096, 4096, 128), (2048, 2048, 64), (2500, 2100, 64),
                                     (1500, 3000, 256), (3000, 1500, 128)])
def test_fast_kernels_long_sequences(sq, sk, d, causal):
    """Many K/V tiles: the producer/consumer ring of the Hopper kernel wraps around many times;
    Sk > 2048 takes the dispatcher's long-key choices (_dispatch.HOPPER_TABLE)."""
    for kernel in _fast_kernels():
        rng = _rng("long", sq, sk, d, causal, kernel)
        q, k, v = random_inputs(rng, (1, 2), (1, 2), sq, sk, d, d, "float16")
        o, lse, label = _run(q, k, v, "float16", causal=causal, kernel=kernel)
        check_against_reference(o, lse, q, k, v, causal=causal, scale=1 / math.sqrt(d),
                                dtype="float16")


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("d", [1, 7, 16, 32, 40, 64, 72, 96, 100, 128, 160, 192, 200, 256])
def test_head_dims(d, dtype, causal):
    _skip_unsupported(dtype)
    rng = _rng("hd", d, dtype, causal)
    q, k, v = random_inputs(rng, (2,), (2,), 113, 200, d, d, dtype)
    o, lse, label = _run(q, k, v, dtype, causal=causal)
    check_against_reference(o, lse, q, k, v, causal=causal, scale=1 / math.sqrt(d), dtype=dtype)


@pytest.mark.parametrize("d,dv", [(64, 32), (32, 128), (256, 8), (5, 256)])
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_dv_differs(d, dv, dtype):
    rng = _rng("dv", d, dv, dtype)
    q, k, v = random_inputs(rng, (3,), (3,), 77, 150, d, dv, dtype)
    o, lse, _ = _run(q, k, v, dtype, causal=True)
    check_against_reference(o, lse, q, k, v, causal=True, scale=1 / math.sqrt(d), dtype=dtype)


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_multi_query_broadcast_and_scale(dtype):
    rng = _rng("mqa", dtype)
    q, k, v = random_inputs(rng, (2, 8), (2, 1), 130, 90, 64, 64, dtype)
    o, lse, _ = _run(q, k, v, dtype, causal=False, scale=0.3)
    check_against_reference(o, lse, q, k, v, causal=False, scale=0.3, dtype=dtype)


def test_two_d_inputs_and_negative_scale():
    rng = _rng("2d")
    q, k, v = random_inputs(rng, (), (), 50, 70, 64, 64, "float16")
    o, lse, _ = _run(q, k, v, "float16", causal=True, scale=-0.2)
    check_against_reference(o, lse, q, k, v, causal=True, scale=-0.2, dtype="float16")


def test_many_batch_axes_unmergeable():
    """Four batch axes broadcast in a pattern no stride merge can collapse to three."""
    rng = _rng("4b")
    q, k, v = random_inputs(rng, (2, 1, 3, 2), (1, 2, 1, 2), 33, 40, 64, 64, "float16")
    o, lse, _ = _run(q, k, v, "float16", causal=False)
    check_against_reference(o, lse, q, k, v, causal=False, scale=1 / 8, dtype="float16")


@pytest.mark.parametrize("kernel", ["auto", "generic"])
def test_strided_bshd_view_is_not_copied(kernel):
    """A (B, S, H, D) buffer passed as a (B, H, S, D) view: used in place, result right."""
    cp = cupy()
    rng = _rng("bshd", kernel)
    B, S, H, D = 2, 300, 4, 128
    x = [reference.round_to(rng.standard_normal((B, S, H, D)), "float16") for _ in range(3)]
    g = [cp.asarray(a.astype(np.float16)) for a in x]
    views = [a.transpose(0, 2, 1, 3) for a in g]
    assert not views[0].flags.c_contiguous
    out = poisoned((B, H, S, D), "float16")
    pool = cp.get_default_memory_pool()
    cuflash.attention(*views, causal=True, out=out, kernel=kernel)  # warm-up: compile
    out.view(cp.uint8).fill(0xFF)
    before = pool.used_bytes()
    cuflash.attention(*views, causal=True, out=out, kernel=kernel)
    assert pool.used_bytes() == before, "no allocation when out= is given"
    ref_in = [a.transpose(0, 2, 1, 3) for a in x]
    check_against_reference(out, None, *ref_in, causal=True, scale=1 / math.sqrt(D), dtype="float16")


def _reversed_view(x64, axes, dtype):
    """A GPU view of `x64` whose `axes` run backwards (negative strides), read in place."""
    flip = tuple(slice(None, None, -1) if a in axes else slice(None) for a in range(x64.ndim))
    g = to_gpu(np.ascontiguousarray(x64[flip]), dtype)[flip]
    assert all(g.strides[a] < 0 for a in axes)
    return g


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("q_axes,kv_axes,hkv", [((1,), (), 4), ((0,), (), 4), ((), (1,), 4),
                                                ((0, 1), (0, 1), 4), ((1,), (), 2)])
def test_auto_on_batch_axes_that_run_backwards(q_axes, kv_axes, hkv, dtype):
    """q[:, ::-1], q[::-1] and such views of k, v (GQA's split head axis too) have negative
    batch strides, which the Hopper kernel's tensor maps cannot take (unsigned): auto takes the
    mma.sync kernel, which reads them through its signed strides, and kernel="hopper" says why
    (before the fix, auto on the H200 failed in cuTensorMapEncodeTiled)."""
    cp = cupy()
    rng = _rng("backwards", q_axes, kv_axes, hkv, dtype)
    B, H, S, D = 2, 4, 200, 128
    q, k, v = random_inputs(rng, (B, H), (B, hkv), S, S, D, D, dtype)
    qg = _reversed_view(q, q_axes, dtype)
    kg, vg = (_reversed_view(x, kv_axes, dtype) for x in (k, v))
    label = cuflash.dispatch_info(qg, kg, vg, causal=True)
    assert label.startswith(("tensorcore<", "hopper<")), label
    if int(cp.cuda.Device().compute_capability) == 90:
        assert label.startswith("tensorcore<"), label
        with pytest.raises(ValueError, match="run backwards"):
            cuflash.attention(qg, kg, vg, causal=True, kernel="hopper")
    o = poisoned((B, H, S, D), dtype)
    lse = poisoned((B, H, S), "float32")
    cuflash.attention(qg, kg, vg, causal=True, return_lse=True, out=(o, lse))
    cp.cuda.get_current_stream().synchronize()
    check_against_reference(o, lse, q, k, v, causal=True, scale=1 / math.sqrt(D), dtype=dtype)


def test_non_contiguous_last_axis_is_copied_and_right():
    cp = cupy()
    rng = _rng("lastaxis")
    q, k, v = random_inputs(rng, (2,), (2,), 40, 50, 32, 32, "float32")
    qg = cp.asarray(np.ascontiguousarray(np.swapaxes(q, -1, -2), dtype=np.float32)).swapaxes(-1, -2)
    assert qg.strides[-1] != qg.itemsize
    o, lse = cuflash.attention(qg, to_gpu(k, "float32"), to_gpu(v, "float32"), return_lse=True)
    check_against_reference(o, lse, q, k, v, causal=False, scale=1 / math.sqrt(32), dtype="float32")


@pytest.mark.parametrize("kernel", ["auto", "generic"])
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_fully_masked_rows(kernel, dtype):
    """Causal with Sq > Sk: the first Sq - Sk rows see nothing -> o = 0, lse = -inf, no NaN."""
    rng = _rng("masked", kernel, dtype)
    q, k, v = random_inputs(rng, (2,), (2,), 200, 30, 64, 64, dtype)
    o, lse, _ = _run(q, k, v, dtype, causal=True, kernel=kernel)
    oh, lh = to_host64(o), to_host64(lse)
    assert np.all(oh[:, :170] == 0) and np.all(np.isneginf(lh[:, :170]))
    check_against_reference(o, lse, q, k, v, causal=True, scale=1 / 8, dtype=dtype)


@pytest.mark.parametrize("kernel", ["auto", "generic"])
def test_nan_propagates(kernel):
    rng = _rng("nan", kernel)
    q, k, v = random_inputs(rng, (), (), 20, 40, 64, 64, "float16")
    q[3, 5] = np.nan
    o, _, _ = _run(q, k, v, "float16", causal=False, kernel=kernel)
    oh = to_host64(o)
    assert np.isnan(oh[3]).all()
    assert not np.isnan(np.delete(oh, 3, axis=0)).any()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_merge_states_splits_keys(dtype):
    _skip_unsupported(dtype)
    rng = _rng("merge", dtype)
    q, k, v = random_inputs(rng, (2, 2), (2, 2), 100, 300, 64, 64, dtype)
    qg, kg, vg = to_gpu(q, dtype), to_gpu(k, dtype), to_gpu(v, dtype)
    o1, l1 = cuflash.attention(qg, kg[..., :120, :], vg[..., :120, :], return_lse=True)
    o2, l2 = cuflash.attention(qg, kg[..., 120:, :], vg[..., 120:, :], return_lse=True)
    o, lse = cuflash.merge_states(o1, l1, o2, l2)
    # The merge weights exp(lse_part - lse) come from float32 lse values (the API's lse dtype):
    # a relative error of a few 2^-24 |lse|, which dominates for float64 outputs.
    lse_max = float(max(cupy().abs(l1).max(), cupy().abs(l2).max()))
    o_max = float(np.abs(reference.attention_ref(q, k, v, scale=1 / 8)[0]).max())
    extra = 8 * 2.0**-24 * max(1.0, lse_max) * o_max
    check_against_reference(o, lse, q, k, v, causal=False, scale=1 / 8, dtype=dtype,
                            extra_tol=extra)


def test_merge_states_empty_partials():
    cp = cupy()
    o = cp.zeros((3, 4), dtype=cp.float32)
    lse = cp.full((3,), -cp.inf, dtype=cp.float32)
    om, lm = cuflash.merge_states(o, lse, o, lse)
    assert not cp.isnan(om).any() and bool(cp.all(cp.isneginf(lm)))


def test_stream_and_cuda_graph_capture():
    """The call runs on the given stream and can be captured in a CUDA graph (no sync, no alloc)."""
    cp = cupy()
    rng = _rng("graph")
    q, k, v = random_inputs(rng, (2, 4), (2, 4), 256, 256, 64, 64, "float16")
    qg, kg, vg = to_gpu(q, "float16"), to_gpu(k, "float16"), to_gpu(v, "float16")
    out = poisoned((2, 4, 256, 64), "float16")
    lse = poisoned((2, 4, 256), "float32")
    s = cp.cuda.Stream(non_blocking=True)
    cuflash.attention(qg, kg, vg, causal=True, out=(out, lse), return_lse=True, stream=s)
    s.synchronize()
    out.view(cp.uint8).fill(0xFF)
    lse.view(cp.uint8).fill(0xFF)
    cp.cuda.Device().synchronize()
    with s:
        s.begin_capture()
        cuflash.attention(qg, kg, vg, causal=True, out=(out, lse), return_lse=True)
        graph = s.end_capture()
    graph.launch(stream=s)
    s.synchronize()
    check_against_reference(out, lse, q, k, v, causal=True, scale=1 / 8, dtype="float16")


def test_torch_dlpack_inputs():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")
    cp = cupy()
    g = torch.Generator(device="cuda").manual_seed(int(SEED % 2**31))
    q, k, v = (torch.randn(2, 4, 120, 64, device="cuda", dtype=torch.bfloat16, generator=g)
               for _ in range(3))
    o = cuflash.attention(q, k, v, causal=True)
    assert isinstance(o, cp.ndarray)
    ot = torch.from_dlpack(o)
    assert ot.dtype == torch.bfloat16 and ot.data_ptr() == o.data.ptr  # zero-copy back
    qh, kh, vh = (x.float().cpu().numpy().astype(np.float64) for x in (q, k, v))
    check_against_reference(o, None, qh, kh, vh, causal=True, scale=1 / 8, dtype="bfloat16")


def test_errors_on_gpu():
    cp = cupy()
    q = cp.ones((2, 8, 64), dtype=cp.float16) * 0.5
    with pytest.raises(ValueError, match="same device"):
        cuflash.attention(q, np.ones((2, 8, 64), np.float16), q)
    with pytest.raises(TypeError, match="out has dtype"):
        cuflash.attention(q, q, q, out=cp.empty((2, 8, 64), cp.float32))
    with pytest.raises(ValueError, match="out has shape"):
        cuflash.attention(q, q, q, out=cp.empty((2, 8, 63), cp.float16))
    with pytest.raises(ValueError, match="tensorcore"):
        cuflash.attention(q.astype(cp.float64), q.astype(cp.float64), q.astype(cp.float64),
                          kernel="tensorcore")
    with pytest.raises(ValueError, match="kernel='hopper' cannot run these inputs"):
        # float64 has no tensor-core form (float32 has: the TF32 Hopper form)
        cuflash.attention(q.astype(cp.float64), q.astype(cp.float64), q.astype(cp.float64),
                          kernel="hopper")
    q32 = cp.ones((2, 8, 32), dtype=cp.float16)
    with pytest.raises(ValueError, match="kernel='hopper' cannot run these inputs"):
        cuflash.attention(q32, q32, q32, kernel="hopper")  # D < 64 (or not a 9.0 GPU)
    with pytest.raises(ValueError, match="out is on"):
        cuflash.attention(q, q, q, out=np.empty((2, 8, 64), np.float16))


@pytest.mark.parametrize("stage_o", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("sq,sk,d", [(1, 1, 64), (300, 30, 128), (257, 1000, 256), (1000, 257, 96),
                                     (113, 113, 40)])
def test_tensorcore_epilogues(sq, sk, d, dtype, causal, stage_o, monkeypatch):
    """Both epilogues of the mma.sync kernel (O staged through shared memory, the default, and
    direct stores from registers): same results, every element written, blocks with no key tile
    included (Sq > Sk, causal)."""
    _skip_unsupported(dtype)
    from cuflash import _dispatch

    cfg = {k: v[:4] + (stage_o,) for k, v in _dispatch.TC_CONFIGS.items()}
    arch_cfg = {a: {k: v[:4] + (stage_o,) for k, v in c.items()}
                for a, c in _dispatch.TC_ARCH_CONFIGS.items()}
    monkeypatch.setattr(_dispatch, "TC_CONFIGS", cfg)
    monkeypatch.setattr(_dispatch, "TC_ARCH_CONFIGS", arch_cfg)
    rng = _rng("staged", sq, sk, d, dtype, causal, stage_o)
    q, k, v = random_inputs(rng, (2,), (2,), sq, sk, d, d, dtype)
    o, lse, label = _run(q, k, v, dtype, causal=causal, kernel="tensorcore")
    assert ("stagedO" in label) == stage_o, label
    check_against_reference(o, lse, q, k, v, causal=causal, scale=1 / math.sqrt(d), dtype=dtype)


_HOPPER_CASES = {}


@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("overlap,pingpong,consumers,q_stages", HOPPER_SCHEDULES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("batch,sq,sk,d", [((2,), 1, 1, 64), ((2,), 300, 30, 128),
                                           ((2,), 257, 1000, 256), ((2,), 1000, 257, 96),
                                           ((4, 40), 200, 300, 64), ((3, 50), 300, 517, 128),
                                           ((2, 70), 130, 200, 256), ((5,), 517, 700, 64),
                                           ((3,), 1000, 1000, 64)])
def test_hopper_schedules(batch, sq, sk, d, causal, overlap, pingpong, consumers, q_stages,
                          persistent, monkeypatch):
    """The Hopper kernel's consumer schedules (softmax of tile j overlapped with P_{j-1} V_{j-1}
    or strictly in sequence; consumers taking turns or not; two or three consumers; one or two
    Q buffers) and its launches (one block per work item, or one per SM looping over items: the
    cases with more items than SMs; causal items in pairs of query blocks, odd counts included)
    against the reference, every element written."""
    if "hopper" not in _fast_kernels():
        pytest.skip("the Hopper kernel needs a compute capability 9.0 GPU")
    from cuflash import _dispatch

    table = hopper_schedule_table(_dispatch.HOPPER_TABLE, overlap, pingpong, consumers, q_stages,
                                  persistent)
    monkeypatch.setattr(_dispatch, "HOPPER_TABLE", table)
    # The schedule under test, not the narrower block short query counts would take instead.
    monkeypatch.setattr(_dispatch, "HOPPER_C3_GAIN", math.inf)
    # One set of random inputs (and its float64 reference) per shape, shared by the schedules.
    case = (batch, sq, sk, d, causal)
    if case not in _HOPPER_CASES:
        q, k, v = random_inputs(_rng("hopper", *case), batch, batch, sq, sk, d, d, "float16")
        _HOPPER_CASES[case] = (q, k, v, reference_result(q, k, v, causal=causal,
                                                         scale=1 / math.sqrt(d), dtype="float16"))
    q, k, v, ref = _HOPPER_CASES[case]
    o, lse, label = _run(q, k, v, "float16", causal=causal, kernel="hopper")
    assert ("overlap" in label) == overlap and ("persistent" in label) == persistent, label
    assert ("pingpong" in label) == pingpong, label
    if d <= 64:
        assert f"BM{64 * consumers}" in label, label
    check_against_reference(o, lse, q, k, v, causal=causal, scale=1 / math.sqrt(d),
                            dtype="float16", ref=ref)


@pytest.mark.parametrize("grid", [None, 3])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("sq,sk,d,consumers", [(1, 1, 64, 2), (7, 7, 128, 2), (113, 113, 64, 3),
                                               (197, 197, 64, 2), (197, 197, 128, 2),
                                               (256, 256, 64, 2), (256, 256, 128, 2),
                                               (577, 577, 64, 3), (577, 577, 128, 2),
                                               (300, 30, 64, 2), (130, 577, 128, 2),
                                               (197, 197, 96, 2), (256, 256, 80, 2)])
def test_hopper_async_o(sq, sk, d, consumers, dtype, causal, grid, monkeypatch):
    """The Hopper kernel's async O epilogue (_dispatch.HOPPER_ASYNC_O: O staged in shared memory
    per warp and sent out row by row with bulk copies the consumers do not wait for until they
    stage the next item's O) against float64 with the pass rule, every element of the NaN-poisoned
    O and lse written: issue 13's small lengths and tails, Sq > Sk under the mask (rows that see
    no key), k and v broadcast over the heads, two and three consumers; D = 64 and 128 send a
    warp's 16 dense rows in one copy (rows past Sq one by one), D = 96 and 80 (padded to 128)
    every row apart. grid = 3: the persistent
    launch on 3 blocks, so that each walks many items and reuses its staging rows while its
    earlier copies may still be in flight."""
    import collections

    if "hopper" not in _fast_kernels():
        pytest.skip("the Hopper kernel needs a compute capability 9.0 GPU")
    _skip_unsupported(dtype)
    from cuflash import _dispatch, _launch

    if grid is not None:
        dev = cupy().cuda.Device().id
        attrs = _launch.device_attributes(dev)
        monkeypatch.setitem(_launch._DEVICE_ATTRS, dev, {**attrs, "sm_count": grid})
        # a parameter block made before keeps its grid: start from an empty cache
        monkeypatch.setattr(_launch, "_PARAM_CACHE", collections.OrderedDict())
    table = {key: (t._replace(consumers=consumers if key[0] == 64 else 2), True)
             for key, (t, _) in _dispatch.HOPPER_TABLE.items()}
    monkeypatch.setattr(_dispatch, "HOPPER_TABLE", table)
    monkeypatch.setattr(_dispatch, "HOPPER_C3_GAIN", math.inf)
    monkeypatch.setattr(_dispatch, "HOPPER_ASYNC_O", True)  # (after the above: the call cache
    # sees every _dispatch assignment and drops its records)
    rng = _rng("async_o", sq, sk, d, consumers, dtype, causal, grid)
    q, k, v = random_inputs(rng, (3, 4), (3, 1), sq, sk, d, d, dtype)
    o, lse, label = _run(q, k, v, dtype, causal=causal, kernel="hopper")
    assert "asyncO" in label and "persistent" in label and f"BM{64 * consumers}" in label, label
    check_against_reference(o, lse, q, k, v, causal=causal, scale=1 / math.sqrt(d), dtype=dtype)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,d", [(197, 64), (256, 128), (77, 64)])
def test_hopper_async_o_strided_out(sq, d, causal, monkeypatch):
    """The async O epilogue into an output whose rows are not dense: `out` a (B, H, S, D) view of
    a NaN-poisoned (B, S, H, D) buffer (row stride H D), so every row leaves by a copy of its own
    at its own address; nothing outside the view's elements is written."""
    if "hopper" not in _fast_kernels():
        pytest.skip("the Hopper kernel needs a compute capability 9.0 GPU")
    from cuflash import _dispatch

    cp = cupy()
    monkeypatch.setattr(_dispatch, "HOPPER_ASYNC_O", True)
    b, h = 2, 3
    rng = _rng("async_o_strided", sq, d, causal)
    q, k, v = random_inputs(rng, (b, h), (b, h), sq, sq, d, d, "float16")
    qg, kg, vg = (to_gpu(x, "float16") for x in (q, k, v))
    buf = poisoned((b, sq, h + 1, d), "float16")  # one head more: its elements stay NaN
    o = buf[:, :, :h, :].transpose(0, 2, 1, 3)
    lse = poisoned((b, h, sq), "float32")
    label = cuflash.dispatch_info(qg, kg, vg, causal=causal, kernel="hopper")
    assert "asyncO" in label, label
    res = cuflash.attention(qg, kg, vg, causal=causal, return_lse=True, out=(o, lse),
                            kernel="hopper")
    assert res[0] is o
    cp.cuda.get_current_stream().synchronize()
    assert bool(cp.isnan(buf[:, :, h, :]).all()), "a copy wrote outside the view"
    check_against_reference(o, lse, q, k, v, causal=causal, scale=1 / math.sqrt(d),
                            dtype="float16")
