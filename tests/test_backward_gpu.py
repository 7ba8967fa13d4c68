"""GPU tests of the backward pass: every backward kernel against the float64 reference gradients
under the gradient pass rule (reference.grad_pass_threshold), on fresh random inputs, with dq,
dk, dv poisoned with NaN so an unwritten element fails; tails, Sq != Sk, causal, head dims,
broadcast (MQA) axes, strided views, rows without keys, bitwise determinism, out= and workspace=
buffers, streams and CUDA-graph capture. Skipped without a GPU."""
import math

import numpy as np
import pytest

import cuflash
import cuflash._checks
from cuflash import reference

from gpu_util import (bf16_dtype, check_grads_against_reference, cupy, grad_reference, poisoned,
                      random_backward_inputs, to_gpu, to_host64)

pytestmark = pytest.mark.gpu

DTYPES = ["float16", "bfloat16", "float32", "float64"]
SHAPES = [(1, 1), (7, 7), (113, 113), (1000, 1000), (1, 1000), (1000, 1), (1000, 7), (113, 1000),
          (257, 64), (64, 257)]
from seeds import SEED, case_rng  # noqa: E402  (fresh every run; see pytest's header)


def _rng(*key):
    return case_rng(SEED, *key)


def _skip_unsupported(dtype):
    if dtype == "bfloat16" and bf16_dtype() is None:
        pytest.skip("bfloat16 on the GPU needs ml_dtypes (CuPy's bfloat16 dtype)")


def _backward_kernels(dtype=None, d=64, dv=None):
    """Backward kernels to force besides "auto": the generic one always; the tensor-core one
    for the inputs it takes (float16 / bfloat16, D == Dv, D % 8 == 0, D <= 128: see
    _dispatch.bwd_tensorcore_reason) and the Hopper one for the same inputs up to D = 256 on a
    compute capability 9.0 device, or all three for every dtype when none is given (tests that
    take the kernel as a parameter skip those that do not apply: _skip_kernel; this form touches
    no GPU, as it runs at collection)."""
    if dtype is None:
        return ["generic", "tensorcore", "hopper"]
    dv = d if dv is None else dv
    return (["generic"] + (["tensorcore"] if _tensorcore_applies(dtype, d, dv) else [])
            + (["hopper"] if _hopper_applies(dtype, d, dv) and _on_hopper() else []))


def _on_hopper():
    from cuflash import _launch

    return _launch.device_attributes(cupy().cuda.Device().id)["compute_capability"] == 90


def _tensorcore_applies(dtype, d, dv, sq=None):
    """The tensor-core backward's conditions: float16 / bfloat16 up to D = 128, or its float32
    ("3xfp16") form up to max(TC_BWD_F16SPLIT_CONFIGS) with at least TC_BWD_F32_MIN_SQ query
    rows (`sq`, when the test knows it)."""
    from cuflash import _dispatch

    if dtype == "float32":
        return (d == dv and d % 8 == 0 and d <= max(_dispatch.TC_BWD_F16SPLIT_CONFIGS)
                and (sq is None or sq >= _dispatch.TC_BWD_F32_MIN_SQ))
    return (dtype in _dispatch.TC_BWD_DTYPES and d == dv and d % 8 == 0
            and d <= max(_dispatch.TC_BWD_CONFIGS))


def _hopper_applies(dtype, d, dv):
    """The Hopper backward's conditions: the tensor-core backward's, up to D = 256."""
    from cuflash import _dispatch

    return (dtype in _dispatch.HOPPER_BWD_DTYPES and d == dv and d % 8 == 0
            and d <= max(_dispatch.HOPPER_BWD_CONFIGS))


def _skip_kernel(kernel, dtype, d, dv=None, sq=None):
    dv = d if dv is None else dv
    if kernel == "tensorcore" and not _tensorcore_applies(dtype, d, dv, sq):
        pytest.skip(f"the tensorcore backward does not take {dtype}, D={d}, Sq={sq} "
                    "(float32 short rows are refused: test_f32_tensorcore_backward_matches_reference)")
    if kernel == "hopper" and not _hopper_applies(dtype, d, dv):
        pytest.skip(f"the {kernel} backward does not take {dtype}, D={d}")
    if kernel == "hopper" and not _on_hopper():
        pytest.skip("the Hopper backward (sm_90a) runs on compute capability 9.0 only")


def _gpu_inputs(q, k, v, do, dtype, *, causal, scale):
    """GPU q, k, v, do and the forward's (o, lse) for them (the auto forward, as a user runs)."""
    qg, kg, vg, dog = (to_gpu(x, dtype) for x in (q, k, v, do))
    o, lse = cuflash.attention(qg, kg, vg, causal=causal, scale=scale, return_lse=True)
    return qg, kg, vg, dog, o, lse


def _run_bwd(inputs, dtype, *, causal, scale=None, kernel="auto", deterministic=False):
    """attention_backward into NaN-poisoned out= buffers; returns (dq, dk, dv), plan label."""
    cp = cupy()
    qg, kg, vg, dog, o, lse = inputs
    outs = tuple(poisoned(x.shape, dtype) for x in (qg, kg, vg))
    label = cuflash.backward_dispatch_info(dog, qg, kg, vg, o, lse, causal=causal,
                                           deterministic=deterministic, kernel=kernel)
    res = cuflash.attention_backward(dog, qg, kg, vg, o, lse, causal=causal, scale=scale,
                                     deterministic=deterministic, out=outs, kernel=kernel)
    assert all(r is b for r, b in zip(res, outs)), "out= buffers are returned"
    cp.cuda.get_current_stream().synchronize()
    return outs, label


_CASES = {}


def _case(key, make):
    """Inputs and float64 reference shared by the kernels run on one case."""
    if key not in _CASES:
        _CASES.clear()  # keep one case's host arrays at a time
        _CASES[key] = make()
    return _CASES[key]


@pytest.mark.parametrize("kernel", ["auto"] + _backward_kernels())
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sq,sk", SHAPES)
def test_backward_matches_reference(sq, sk, dtype, causal, kernel):
    _skip_unsupported(dtype)
    d = [64, 128, 256, 96][(sq + sk) % 4]
    _skip_kernel(kernel, dtype, d, sq=sq)
    batch = (2, 3) if max(sq, sk) < 1000 else (1, 2)
    scale = 1 / math.sqrt(d)

    def make():
        q, k, v, do = random_backward_inputs(_rng("bwd", sq, sk, dtype, causal), batch, batch,
                                             sq, sk, d, d, dtype)
        return (q, k, v, do), grad_reference(do, q, k, v, causal=causal, scale=scale,
                                             dtype=dtype)

    (q, k, v, do), ref = _case(("bwd", sq, sk, dtype, causal), make)
    inputs = _gpu_inputs(q, k, v, do, dtype, causal=causal, scale=scale)
    grads, label = _run_bwd(inputs, dtype, causal=causal, kernel=kernel)
    if kernel == "generic":
        assert label.startswith("generic-bwd"), label
    if kernel == "tensorcore":
        assert label.startswith("tensorcore-bwd"), label
    if kernel == "hopper":
        assert label.startswith("hopper-bwd"), label
    if kernel == "auto" and _hopper_applies(dtype, d, d) and _on_hopper():  # HOPPER_BWD_AUTO
        assert label.startswith("hopper-bwd"), label
    elif kernel == "auto" and _tensorcore_applies(dtype, d, d, sq) and dtype != "float32":
        assert label.startswith(("tensorcore-bwd", "hopper-bwd")), label
    check_grads_against_reference(grads, do, q, k, v, causal=causal, scale=scale, dtype=dtype,
                                  ref=ref, label=label)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
@pytest.mark.parametrize("d", [1, 7, 16, 32, 40, 64, 72, 96, 100, 128, 160, 192, 200, 256])
def test_backward_head_dims(d, dtype, causal):
    _skip_unsupported(dtype)
    q, k, v, do = random_backward_inputs(_rng("hd", d, dtype, causal), (2,), (2,), 113, 200, d,
                                         d, dtype)
    inputs = _gpu_inputs(q, k, v, do, dtype, causal=causal, scale=None)
    for kernel in ["auto"] + _backward_kernels(dtype, d):
        grads, label = _run_bwd(inputs, dtype, causal=causal, kernel=kernel)
        check_grads_against_reference(grads, do, q, k, v, causal=causal, scale=1 / math.sqrt(d),
                                      dtype=dtype, label=label)


@pytest.mark.parametrize("d,dv", [(64, 32), (32, 128), (256, 8), (5, 256), (16, 200)])
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_backward_dv_differs(d, dv, dtype):
    q, k, v, do = random_backward_inputs(_rng("dv", d, dv, dtype), (3,), (3,), 77, 150, d, dv,
                                         dtype)
    inputs = _gpu_inputs(q, k, v, do, dtype, causal=True, scale=None)
    grads, label = _run_bwd(inputs, dtype, causal=True)
    check_grads_against_reference(grads, do, q, k, v, causal=True, scale=1 / math.sqrt(d),
                                  dtype=dtype, label=label)


BROADCASTS = [
    ((2, 8), (2, 1), (2, 1)),        # MQA: dk, dv summed over the 8 query heads
    ((2, 2, 3), (2, 2, 1), (2, 2, 1)),  # GQA as (B, Hkv, group): summed over each group
    ((1, 4), (3, 4), (3, 4)),        # q shared by the batch: dq summed over it
    ((2, 4), (2, 1), (2, 4)),        # k and v broadcast differently (temporaries)
    ((2, 1, 3, 2), (1, 2, 1, 2), (1, 2, 1, 2)),  # four axes no stride pattern merges
    ((), (3,), (3,)),                # 2-D q against batched k, v
]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("qb,kb,vb", BROADCASTS)
def test_backward_broadcast_axes_are_summed(qb, kb, vb, dtype, causal):
    q, k, v, do = random_backward_inputs(_rng("bc", qb, kb, vb, dtype, causal), qb, kb, 130, 90,
                                         64, 64, dtype, batch_v=vb)
    inputs = _gpu_inputs(q, k, v, do, dtype, causal=causal, scale=0.3)
    ref = grad_reference(do, q, k, v, causal=causal, scale=0.3, dtype=dtype)
    for kernel in ["auto"] + _backward_kernels(dtype, 64):
        grads, label = _run_bwd(inputs, dtype, causal=causal, scale=0.3, kernel=kernel)
        check_grads_against_reference(grads, do, q, k, v, causal=causal, scale=0.3, dtype=dtype,
                                      ref=ref, label=label)


@pytest.mark.parametrize("kernel,D", [(k, 128) for k in ["auto"] + _backward_kernels()]
                         + [("hopper", 256)])
def test_backward_strided_bshd_views(kernel, D):
    """(B, S, H, D) buffers passed as (B, H, S, D) views, outputs too: used in place."""
    _skip_kernel(kernel, "float16", D)
    cp = cupy()
    rng = _rng("bshd", kernel, D)
    B, S, H = 2, 300, 4
    x = [reference.round_to(rng.standard_normal((B, S, H, D)), "float16") for _ in range(4)]
    g = [cp.asarray(a.astype(np.float16)).transpose(0, 2, 1, 3) for a in x]
    assert not g[0].flags.c_contiguous
    o, lse = cuflash.attention(*g[:3], causal=True, return_lse=True)
    outs = [poisoned((B, S, H, D), "float16").transpose(0, 2, 1, 3) for _ in range(3)]
    res = cuflash.attention_backward(g[3], *g[:3], o, lse, causal=True, out=tuple(outs),
                                     kernel=kernel)
    assert all(r is b for r, b in zip(res, outs))
    cp.cuda.get_current_stream().synchronize()
    q, k, v, do = (a.transpose(0, 2, 1, 3) for a in x)
    check_grads_against_reference(outs, do, q, k, v, causal=True, scale=1 / math.sqrt(D),
                                  dtype="float16", label=f"bshd {kernel}")


def test_backward_non_contiguous_last_axis():
    cp = cupy()
    q, k, v, do = random_backward_inputs(_rng("last"), (2,), (2,), 40, 50, 32, 32, "float32")
    qg = cp.asarray(np.ascontiguousarray(np.swapaxes(q, -1, -2), dtype=np.float32)).swapaxes(-1, -2)
    assert qg.strides[-1] != qg.itemsize
    kg, vg, dog = (to_gpu(x, "float32") for x in (k, v, do))
    o, lse = cuflash.attention(qg, kg, vg, return_lse=True)
    lse_view = cp.asarray(np.repeat(cp.asnumpy(lse)[..., None], 2, axis=-1))[..., 0]  # strided lse
    assert lse_view.strides[-1] != 4
    grads = cuflash.attention_backward(dog, qg, kg, vg, o, lse_view)
    check_grads_against_reference(grads, do, q, k, v, causal=False, scale=1 / math.sqrt(32),
                                  dtype="float32", label="non-contiguous")


@pytest.mark.parametrize("kernel", ["auto"] + _backward_kernels())
@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_rows_without_keys(kernel, dtype):
    """Causal with Sq > Sk: the first Sq - Sk rows see no key: their dq is exactly 0, no NaN
    anywhere, and they add nothing to dk, dv."""
    _skip_unsupported(dtype)
    _skip_kernel(kernel, dtype, 64)
    q, k, v, do = random_backward_inputs(_rng("nokey", kernel, dtype), (2,), (2,), 200, 30, 64,
                                         64, dtype)
    inputs = _gpu_inputs(q, k, v, do, dtype, causal=True, scale=None)
    assert bool(cupy().all(cupy().isneginf(inputs[5][:, :170])))
    grads, label = _run_bwd(inputs, dtype, causal=True, kernel=kernel)
    assert np.all(to_host64(grads[0])[:, :170] == 0), f"{label}: rows without keys have dq != 0"
    check_grads_against_reference(grads, do, q, k, v, causal=True, scale=1 / 8, dtype=dtype,
                                  label=label)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk,d", [(2048, 2048, 128), (2500, 2100, 64), (1500, 3000, 256)])
def test_backward_long_sequences(sq, sk, d, causal):
    q, k, v, do = random_backward_inputs(_rng("long", sq, sk, d, causal), (1, 2), (1, 2), sq, sk,
                                         d, d, "float16")
    inputs = _gpu_inputs(q, k, v, do, "float16", causal=causal, scale=None)
    ref = grad_reference(do, q, k, v, causal=causal, scale=1 / math.sqrt(d), dtype="float16")
    for kernel in ["auto"] + _backward_kernels("float16", d):
        grads, label = _run_bwd(inputs, "float16", causal=causal, kernel=kernel)
        check_grads_against_reference(grads, do, q, k, v, causal=causal, scale=1 / math.sqrt(d),
                                      dtype="float16", ref=ref, label=label)


@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize("kernel", ["auto"] + _backward_kernels())
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_backward_bitwise_reproducible(dtype, kernel, deterministic):
    """deterministic=True: repeated calls give bitwise-identical dq, dk, dv, also when the
    launch differs (one batch entry alone: another grid, the same bits for that entry). The
    default mode may use float atomics (then only the pass rule is checked), except in plans
    that say they are deterministic (the generic one)."""
    cp = cupy()
    from cuflash import _dispatch, _launch

    _skip_kernel(kernel, dtype, 128)
    q, k, v, do = random_backward_inputs(_rng("det", dtype, kernel), (2, 4), (2, 4), 1000, 1000,
                                         128, 128, dtype)
    inputs = _gpu_inputs(q, k, v, do, dtype, causal=True, scale=None)
    first, label = _run_bwd(inputs, dtype, causal=True, kernel=kernel,
                            deterministic=deterministic)
    prob = cuflash._checks.check_backward(*inputs[3:4], *inputs[:3], *inputs[4:], causal=True,
                                          scale=None, deterministic=deterministic, out=None,
                                          workspace=None, stream=None, kernel=kernel)
    cc = _launch.device_attributes(prob.device_id)["compute_capability"]
    plan = _dispatch.backward_plan_for(prob, cc)
    if deterministic:
        assert plan.deterministic, f"{plan.label} was chosen for deterministic=True"
    for _ in range(3 if plan.deterministic else 0):
        again, _ = _run_bwd(inputs, dtype, causal=True, kernel=kernel,
                            deterministic=deterministic)
        for name, a, b in zip(("dq", "dk", "dv"), first, again):
            assert bool(cp.all(a.view(cp.uint8) == b.view(cp.uint8))), \
                f"{label}: {name} differs between two identical calls"
    if deterministic:
        qg, kg, vg, dog, o, lse = inputs
        sl = (slice(1, 2), slice(2, 3))
        one = cuflash.attention_backward(dog[sl], qg[sl], kg[sl], vg[sl], o[sl], lse[sl],
                                         causal=True, deterministic=True, kernel=kernel)
        for name, a, b in zip(("dq", "dk", "dv"), first, one):
            assert bool(cp.all(a[sl].view(cp.uint8) == b.view(cp.uint8))), \
                f"{label}: {name} of batch entry (1, 2) depends on the launch (batch size)"
    check_grads_against_reference(first, do, q, k, v, causal=True, scale=1 / math.sqrt(128),
                                  dtype=dtype, label=label)


def test_backward_workspace_no_allocation_and_cuda_graph():
    """With out= and workspace= nothing is allocated, so the call can be captured in a CUDA graph
    on a stream; the replay gives the same bits as a direct call (deterministic=True: the
    default tensor-core plan adds dq with float atomics, whose order may differ between runs)."""
    cp = cupy()
    q, k, v, do = random_backward_inputs(_rng("graph"), (2, 4), (2, 4), 256, 300, 64, 64,
                                         "float16")
    qg, kg, vg, dog, o, lse = _gpu_inputs(q, k, v, do, "float16", causal=True, scale=None)
    size = cuflash.attention_backward_workspace_size(dog, qg, kg, vg, o, lse, causal=True,
                                                     deterministic=True)
    assert size >= 2 * 4 * 256 * 4  # delta, float32
    ws = cp.empty(size, dtype=cp.uint8)
    outs = tuple(poisoned(x.shape, "float16") for x in (qg, kg, vg))
    s = cp.cuda.Stream(non_blocking=True)
    args = (dog, qg, kg, vg, o, lse)
    cuflash.attention_backward(*args, causal=True, out=outs, workspace=ws, stream=s,
                               deterministic=True)  # compile
    s.synchronize()
    direct = [x.copy() for x in outs]
    pool = cp.get_default_memory_pool()
    for x in outs:
        x.view(cp.uint8).fill(0xFF)
    cp.cuda.Device().synchronize()
    before = pool.used_bytes()
    with s:
        s.begin_capture()
        cuflash.attention_backward(*args, causal=True, out=outs, workspace=ws,
                                   deterministic=True)
        graph = s.end_capture()
    assert pool.used_bytes() == before, "no allocation with out= and workspace="
    graph.launch(stream=s)
    s.synchronize()
    for name, a, b in zip(("dq", "dk", "dv"), direct, outs):
        assert bool(cp.all(a.view(cp.uint8) == b.view(cp.uint8))), f"graph replay {name} differs"
    check_grads_against_reference(outs, do, q, k, v, causal=True, scale=1 / 8, dtype="float16",
                                  label="graph")


def test_backward_allocates_outputs_and_negative_scale():
    q, k, v, do = random_backward_inputs(_rng("alloc"), (), (), 50, 70, 64, 64, "float16")
    qg, kg, vg, dog, o, lse = _gpu_inputs(q, k, v, do, "float16", causal=True, scale=-0.2)
    grads = cuflash.attention_backward(dog, qg, kg, vg, o, lse, causal=True, scale=-0.2)
    assert all(isinstance(g, cupy().ndarray) for g in grads)
    check_grads_against_reference(grads, do, q, k, v, causal=True, scale=-0.2, dtype="float16",
                                  label="alloc")


def test_backward_torch_inputs_match_autograd():
    """Torch tensors through DLPack, and the same gradients as torch's own autograd of the
    float64 math (a second, independent reference)."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")
    g = torch.Generator(device="cuda").manual_seed(int(SEED % 2**31))
    q, k, v, do = (torch.randn(2, 4, 120, 64, device="cuda", dtype=torch.float32, generator=g)
                   for _ in range(4))
    o, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
    dq, dk, dv = cuflash.attention_backward(do, q, k, v, o, lse, causal=True)
    q64, k64, v64 = (x.double().detach().requires_grad_() for x in (q, k, v))
    o64 = torch.nn.functional.scaled_dot_product_attention(q64, k64, v64, is_causal=True)
    o64.backward(do.double())
    for name, a, b in (("dq", dq, q64.grad), ("dk", dk, k64.grad), ("dv", dv, v64.grad)):
        err = float(np.max(np.abs(to_host64(a) - b.cpu().numpy())))
        assert err < 1e-4, f"{name} vs torch autograd (float64): {err:.3e}"


def test_backward_errors_on_gpu():
    cp = cupy()
    x = cp.ones((2, 8, 64), dtype=cp.float16) * 0.5
    o, lse = cuflash.attention(x, x, x, return_lse=True)
    with pytest.raises(ValueError, match="do is on the CPU"):
        cuflash.attention_backward(np.ones((2, 8, 64), np.float16), x, x, x, o, lse)
    with pytest.raises(ValueError, match="workspace has 8 bytes"):
        cuflash.attention_backward(o, x, x, x, o, lse, workspace=cp.empty(8, cp.uint8))
    with pytest.raises(ValueError, match="out\\[1\\] \\(dk\\) is on"):
        cuflash.attention_backward(o, x, x, x, o, lse,
                                   out=(cp.empty_like(x), np.empty((2, 8, 64), np.float16),
                                        cp.empty_like(x)))
    x64 = x.astype(cp.float64)
    o64, lse64 = cuflash.attention(x64, x64, x64, return_lse=True)
    with pytest.raises(ValueError, match="tensorcore"):
        cuflash.attention_backward(o64, x64, x64, x64, o64, lse64, kernel="tensorcore")
    with pytest.raises(TypeError, match="lse has dtype float16"):
        cuflash.attention_backward(o, x, x, x, o, lse.astype(cp.float16))


# ---------------------------------------------------------------------------------------------
# The tensor-core backward (kernels_cu/attn_bwd_mma.cu) specifically

@pytest.mark.parametrize("kernel", ["auto", "hopper"])
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [16, 40, 64, 72, 96, 128])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_tensorcore_backward_head_dims_and_modes(dtype, d, causal, deterministic, kernel):
    """Every padded head dim, both masks, both dq modes; Sq != Sk with tails on both sides.
    "auto": the tensor-core backward (or the Hopper one with _dispatch.HOPPER_BWD_AUTO);
    "hopper" forced (its D = 64 and 128 tiles, smaller head dims padded)."""
    _skip_unsupported(dtype)
    _skip_kernel(kernel, dtype, d)
    q, k, v, do = random_backward_inputs(_rng("tc", dtype, d, causal, deterministic, kernel),
                                         (2, 3), (2, 3), 177, 113, d, d, dtype)
    inputs = _gpu_inputs(q, k, v, do, dtype, causal=causal, scale=None)
    grads, label = _run_bwd(inputs, dtype, causal=causal, kernel=kernel,
                            deterministic=deterministic)
    want = ("hopper-bwd",) if kernel == "hopper" else ("tensorcore-bwd", "hopper-bwd")
    assert label.startswith(want), label
    assert ("det," in label) == deterministic, label
    check_grads_against_reference(grads, do, q, k, v, causal=causal, scale=1 / math.sqrt(d),
                                  dtype=dtype, label=label)


@pytest.mark.parametrize("kernel,d", [("auto", 64), ("hopper", 64), ("hopper", 128)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_tensorcore_deterministic_mqa_is_bitwise_and_grid_independent(dtype, causal, kernel, d):
    """MQA (dk, dv summed over 8 query heads inside a block; dq tiles of each query head
    ordered by their turn counters): repeated calls give the same bits, and the first batch
    entry alone (a smaller grid) gives the same bits as in the full batch. "auto": the
    tensor-core backward (or the Hopper one with _dispatch.HOPPER_BWD_AUTO); "hopper" forced."""
    _skip_unsupported(dtype)
    _skip_kernel(kernel, dtype, d)
    cp = cupy()
    q, k, v, do = random_backward_inputs(_rng("tcdet", dtype, causal, kernel, d), (3, 8), (3, 1),
                                         1000, 700, d, d, dtype)
    inputs = _gpu_inputs(q, k, v, do, dtype, causal=causal, scale=None)
    first, label = _run_bwd(inputs, dtype, causal=causal, deterministic=True, kernel=kernel)
    want = ("hopper-bwd",) if kernel == "hopper" else ("tensorcore-bwd", "hopper-bwd")
    assert label.startswith(want) and "det," in label, label
    for _ in range(2):
        again, _ = _run_bwd(inputs, dtype, causal=causal, deterministic=True, kernel=kernel)
        for name, a, b in zip(("dq", "dk", "dv"), first, again):
            assert bool(cp.all(a.view(cp.uint8) == b.view(cp.uint8))), f"{label}: {name} differs"
    qg, kg, vg, dog, o, lse = inputs
    one = cuflash.attention_backward(dog[:1], qg[:1], kg[:1], vg[:1], o[:1], lse[:1],
                                     causal=causal, deterministic=True, kernel=kernel)
    for name, a, b in zip(("dq", "dk", "dv"), first, one):
        assert bool(cp.all(a[:1].view(cp.uint8) == b.view(cp.uint8))), \
            f"{label}: {name} of batch entry 0 depends on the batch size"
    check_grads_against_reference(first, do, q, k, v, causal=causal, scale=1 / math.sqrt(d),
                                  dtype=dtype, label=label)


def test_tensorcore_backward_fallbacks_say_why():
    """Inputs the tensor-core backward does not take run the generic one under "auto", with the
    reason in backward_dispatch_info, and raise under kernel="tensorcore"."""
    cp = cupy()
    rng = _rng("tcfall")
    # rows that do not start on 16-byte boundaries: a view one element into a wider buffer
    wide = [to_gpu(reference.round_to(rng.standard_normal((2, 90, 72)), "float16"), "float16")
            for _ in range(4)]
    q, k, v, do = (x[..., 1:65] for x in wide)
    o, lse = cuflash.attention(q, k, v, return_lse=True)
    info = cuflash.backward_dispatch_info(do, q, k, v, o, lse)
    assert info.startswith("generic-bwd") and "16-byte" in info, info
    with pytest.raises(ValueError, match="16-byte"):
        cuflash.attention_backward(do, q, k, v, o, lse, kernel="tensorcore")
    grads = cuflash.attention_backward(do, q, k, v, o, lse)
    h = [to_host64(x) for x in (q, k, v, do)]
    check_grads_against_reference(grads, h[3], *h[:3], causal=False, scale=1 / 8,
                                  dtype="float16", label=info)
    # deterministic with a broadcast q (dq summed over the batch): generic
    x = cp.asarray(rng.standard_normal((1, 4, 50, 64)).astype(np.float16))
    kv = cp.asarray(rng.standard_normal((3, 4, 50, 64)).astype(np.float16))
    o, lse = cuflash.attention(x, kv, kv, return_lse=True)
    info = cuflash.backward_dispatch_info(o, x, kv, kv, o, lse, deterministic=True)
    assert info.startswith("generic-bwd") and "broadcast q" in info, info
    from cuflash import _dispatch

    hopper = _dispatch.HOPPER_BWD_AUTO and cp.cuda.Device().compute_capability == "90"
    assert cuflash.backward_dispatch_info(o, x, kv, kv, o, lse).startswith(
        "hopper-bwd" if hopper else "tensorcore-bwd")
    # D = 256 (the Hopper backward takes it; elsewhere generic) and float32 with 40 query rows
    # (the float32 tensor-core backward takes Sq >= TC_BWD_F32_MIN_SQ when TC_BWD_F32_AUTO is on;
    # else only 16-bit inputs reach a tensor-core backward): generic, with the reason
    f32_why = (f"Sq >= {_dispatch.TC_BWD_F32_MIN_SQ}" if _dispatch.TC_BWD_F32_AUTO
               else "float16 and bfloat16")
    for shape, dt, why in (((2, 40, 256), cp.float16, "up to 128"),
                           ((2, 40, 64), cp.float32, f32_why)):
        y = cp.asarray(rng.standard_normal(shape)).astype(dt)
        o, lse = cuflash.attention(y, y, y, return_lse=True)
        info = cuflash.backward_dispatch_info(o, y, y, y, o, lse)
        if hopper and dt == cp.float16:
            assert info.startswith("hopper-bwd<float16,D256,BM64,BN64,"), info
        else:
            assert info.startswith("generic-bwd") and why in info, info


# ---------------------------------------------------------------------------------------------
# The tensor-core backward's speed candidates (_dispatch.TC_BWD_CANDIDATES, notes/BACKWARD.md
# "Speed candidates"), each in place of the default tiles: gradients against float64 with the
# project's rule, and deterministic=True bitwise reproducible and grid-independent. The "lean" and
# "late" OPT bits change no arithmetic and no order: their deterministic results must be the
# default tiles' bits.

def _candidate_cases():
    from cuflash import _dispatch

    return [(name, dpad) for name, cand in _dispatch.TC_BWD_CANDIDATES.items() for dpad in cand]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("cand,dpad", _candidate_cases())
def test_tensorcore_backward_candidates(cand, dpad, causal, monkeypatch):
    cp = cupy()
    from cuflash import _dispatch

    base = dict(_dispatch.TC_BWD_CONFIGS)
    d = dpad - 8  # padded: zero-filled columns
    q, k, v, do = random_backward_inputs(_rng("cand", cand, dpad, causal), (2, 2), (2, 2), 1000,
                                         1113, d, d, "float16")
    ref = grad_reference(do, q, k, v, causal=causal, scale=None, dtype="float16")
    inputs = _gpu_inputs(q, k, v, do, "float16", causal=causal, scale=None)
    det_base, _ = _run_bwd(inputs, "float16", causal=causal, kernel="tensorcore",
                           deterministic=True)
    monkeypatch.setattr(_dispatch, "TC_BWD_CONFIGS",
                        {**base, **_dispatch.TC_BWD_CANDIDATES[cand]})
    cc = _launch_cc(inputs)
    bm, nwarps, _, _, opt = _dispatch.bwd_tensorcore_config(dpad, cc)
    for deterministic in (False, True):
        grads, label = _run_bwd(inputs, "float16", causal=causal, kernel="tensorcore",
                                deterministic=deterministic)
        assert f"BM{bm},BN{16 * nwarps}," in label, label
        for opt_name, bit in _dispatch.TC_BWD_OPTS.items():  # the candidate's OPT bits ran
            want = bool(opt & bit) and (deterministic or opt_name != "late")
            assert (f"{opt_name}," in label) == want, label
        check_grads_against_reference(grads, do, q, k, v, causal=causal, scale=None,
                                      dtype="float16", ref=ref, label=label)
    again, _ = _run_bwd(inputs, "float16", causal=causal, kernel="tensorcore",
                        deterministic=True)
    qg, kg, vg, dog, o, lse = inputs
    one = cuflash.attention_backward(dog[1:], qg[1:], kg[1:], vg[1:], o[1:], lse[1:],
                                     causal=causal, deterministic=True, kernel="tensorcore")
    same_tiles = _dispatch.TC_BWD_CANDIDATES[cand][dpad][:2] == base[dpad][:2]
    for name, a, b, c, e in zip(("dq", "dk", "dv"), grads, again, one, det_base):
        assert bool(cp.all(a.view(cp.uint8) == b.view(cp.uint8))), \
            f"{label}: {name} differs between two identical calls"
        assert bool(cp.all(a[1:].view(cp.uint8) == c.view(cp.uint8))), \
            f"{label}: {name} of batch entry 1 depends on the launch (batch size)"
        if same_tiles:  # OPT bits only: the same additions in the same order
            assert bool(cp.all(a.view(cp.uint8) == e.view(cp.uint8))), \
                f"{label}: {name} differs from the default tiles' deterministic result"


def _launch_cc(inputs):
    from cuflash import _launch

    return _launch.device_attributes(inputs[0].device.id)["compute_capability"]


# ---------------------------------------------------------------------------------------------
# The Hopper backward (kernels_cu/attn_bwd_wgmma.cu) specifically: kernel="hopper" (auto takes it
# only with _dispatch.HOPPER_BWD_AUTO). The tests above that take the kernel as a parameter run it
# too (tails, Sq != Sk, head dims, rows without keys, broadcast axes, strided views, determinism,
# MQA turns).

def _need_hopper():
    if not _on_hopper():
        pytest.skip("the Hopper backward (sm_90a) runs on compute capability 9.0 only")


def test_hopper_backward_refusals_say_why():
    """kernel="hopper" raises with the reason for inputs it does not take."""
    _need_hopper()
    cp = cupy()
    rng = _rng("hopfall")
    for shape, dt, why in (((2, 40, 60), cp.float16, "multiple of 8"),
                           ((2, 40, 64), cp.float32, "float16 and bfloat16")):
        y = cp.asarray(rng.standard_normal(shape)).astype(dt)
        o, lse = cuflash.attention(y, y, y, return_lse=True)
        with pytest.raises(ValueError, match=f"kernel='hopper'.*{why}"):
            cuflash.attention_backward(o, y, y, y, o, lse, kernel="hopper")


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_hopper_backward_other_ds_layout(dtype, causal, d, monkeypatch):
    """dQ with dS^T read M-major (_dispatch.HOPPER_BWD_DS_KMAJOR = False: half the dS stores, an
    operand form the forward never runs): the gradients against float64, deterministic bitwise
    reproducible, in both modes."""
    _skip_unsupported(dtype)
    _need_hopper()
    from cuflash import _dispatch

    monkeypatch.setattr(_dispatch, "HOPPER_BWD_DS_KMAJOR", False)
    q, k, v, do = random_backward_inputs(_rng("hopdst", dtype, causal, d), (2, 3), (2, 3), 1000,
                                         1113, d, d, dtype)
    inputs = _gpu_inputs(q, k, v, do, dtype, causal=causal, scale=None)
    _check_hopper_modes(inputs, (q, k, v, do), dtype, causal, "dsT,")


def _check_hopper_modes(inputs, host, dtype, causal, want):
    """kernel="hopper" in both dq modes against float64 (labels holding `want`), and the
    deterministic mode bitwise the same on a second call; returns its (dq, dk, dv), label."""
    cp = cupy()
    q, k, v, do = host
    ref = grad_reference(do, q, k, v, causal=causal, scale=None, dtype=dtype)
    for det in (False, True):
        grads, label = _run_bwd(inputs, dtype, causal=causal, kernel="hopper", deterministic=det)
        assert label.startswith("hopper-bwd") and want in label, label
        assert ("det," in label) == det, label
        check_grads_against_reference(grads, do, q, k, v, causal=causal, scale=None, dtype=dtype,
                                      ref=ref, label=label)
    again, _ = _run_bwd(inputs, dtype, causal=causal, kernel="hopper", deterministic=True)
    for name, a, b in zip(("dq", "dk", "dv"), grads, again):
        assert bool(cp.all(a.view(cp.uint8) == b.view(cp.uint8))), f"{label}: {name} differs"
    return grads, label


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("d", [200, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_hopper_backward_d256(dtype, causal, d, overlap, monkeypatch):
    """D = 256 (and a head dim padded to it): two warpgroups share each block's 64 keys
    (attn_bwd_wgmma.cu, SPLIT), in both schedules (overlap: _dispatch.HOPPER_BWD_OVERLAP, label
    "ov,"). MQA (dk, dv summed over 4 query heads), Sq != Sk with tails on both sides (1000
    queries: 15 tiles of 64 and 40 rows; 1113 keys: 17 blocks and 25 keys), NaN-poisoned
    outputs, both dq modes against float64; deterministic: bitwise the same on a second call
    and for batch entry 1 alone (a smaller grid)."""
    _skip_unsupported(dtype)
    _need_hopper()
    from cuflash import _dispatch

    monkeypatch.setattr(_dispatch, "HOPPER_BWD_OVERLAP", overlap)
    cp = cupy()
    q, k, v, do = random_backward_inputs(_rng("hop256", dtype, causal, d), (2, 4), (2, 1), 1000,
                                         1113, d, d, dtype)
    inputs = _gpu_inputs(q, k, v, do, dtype, causal=causal, scale=None)
    grads, label = _check_hopper_modes(inputs, (q, k, v, do), dtype, causal, "D256,BM64,BN64,")
    assert ("ov," in label) == overlap, label
    qg, kg, vg, dog, o, lse = inputs
    one = cuflash.attention_backward(dog[1:], qg[1:], kg[1:], vg[1:], o[1:], lse[1:],
                                     causal=causal, deterministic=True, kernel="hopper")
    for name, a, b in zip(("dq", "dk", "dv"), grads, one):
        assert bool(cp.all(a[1:].view(cp.uint8) == b.view(cp.uint8))), \
            f"{label}: {name} of batch entry 1 depends on the batch size"


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_hopper_backward_d256_schedules_agree(dtype, causal, monkeypatch):
    """The D = 256 form's two schedules (_dispatch.HOPPER_BWD_OVERLAP off and on) run the same
    products on the same operands and, deterministic, add dq in the same order: dq, dk and dv
    are bitwise the same (and dk, dv without determinism, which has no atomics for them), so a
    phase that reads a buffer before it is written or after it is reused shows up here even
    where the error would stay under the rule. 4 heads of 1500 queries x 2100 keys (tails: 28
    rows, 52 keys; 132 blocks), outputs NaN-poisoned, each schedule also against float64."""
    _skip_unsupported(dtype)
    _need_hopper()
    from cuflash import _dispatch

    cp = cupy()
    q, k, v, do = random_backward_inputs(_rng("hop256ov", dtype, causal), (1, 4), (1, 4), 1500,
                                         2100, 256, 256, dtype)
    inputs = _gpu_inputs(q, k, v, do, dtype, causal=causal, scale=None)
    ref = grad_reference(do, q, k, v, causal=causal, scale=None, dtype=dtype)
    got = {}
    for overlap in (False, True):
        monkeypatch.setattr(_dispatch, "HOPPER_BWD_OVERLAP", overlap)
        for det in (False, True):
            grads, label = _run_bwd(inputs, dtype, causal=causal, kernel="hopper",
                                    deterministic=det)
            assert ("ov," in label) == overlap and ("det," in label) == det, label
            check_grads_against_reference(grads, do, q, k, v, causal=causal, scale=None,
                                          dtype=dtype, ref=ref, label=label)
            got[overlap, det] = grads
    for det in (False, True):
        names = ("dq", "dk", "dv") if det else ("dk", "dv")
        for name in names:
            i = ("dq", "dk", "dv").index(name)
            a, b = got[False, det][i], got[True, det][i]
            assert bool(cp.all(a.view(cp.uint8) == b.view(cp.uint8))), \
                f"D = 256 {'det' if det else 'default'}: {name} differs between the schedules"


# ---------------------------------------------------------------------------------------------
# The float32 tensor-core backward (attn_bwd_mma.cu, T = float, OP = fp16_t: "3xfp16", with the
# tensor-core stats pass cuflash_bwd_stats_mma): kernel="tensorcore" (auto only with
# _dispatch.TC_BWD_F32_AUTO). The tests above that take the kernel as a parameter run it too where
# _tensorcore_applies (head dims 16-64, rows without keys, broadcast axes); these add tails on
# both sides, both dq modes, strided MQA views and magnitudes far from 1.

F32_TC_SHAPES = [(1, 1), (7, 7), (113, 113), (1000, 1000), (1, 1000), (1000, 1), (1000, 7),
                 (113, 1000), (7, 113), (257, 64)]


def _f32_tc_label_ok(label, deterministic):
    assert label.startswith("tensorcore-bwd<float32,3xfp16,"), label
    assert ("det," in label) == deterministic, label


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", F32_TC_SHAPES)
def test_f32_tensorcore_backward_matches_reference(sq, sk, causal, deterministic):
    """float32 kernel="tensorcore": tails 1, 7, 113, 1000 on both sides, Sq != Sk, both masks,
    both dq modes, head dims 64 and padded ones (40, 16, 56), NaN-poisoned outputs, against the
    float64 gradients under the pass rule; deterministic=True bitwise the same on a second call."""
    cp = cupy()
    from cuflash import _dispatch

    d = [64, 40, 16, 56][(sq + sk) % 4]
    batch = (2, 3) if max(sq, sk) < 1000 else (1, 2)
    q, k, v, do = random_backward_inputs(_rng("f32tc", sq, sk, causal, deterministic), batch,
                                         batch, sq, sk, d, d, "float32")
    inputs = _gpu_inputs(q, k, v, do, "float32", causal=causal, scale=None)
    if sq < _dispatch.TC_BWD_F32_MIN_SQ:   # short rows: refused, never over the rule
        with pytest.raises(ValueError, match="Sq >="):
            _run_bwd(inputs, "float32", causal=causal, kernel="tensorcore",
                     deterministic=deterministic)
        return
    grads, label = _run_bwd(inputs, "float32", causal=causal, kernel="tensorcore",
                            deterministic=deterministic)
    _f32_tc_label_ok(label, deterministic)
    check_grads_against_reference(grads, do, q, k, v, causal=causal, scale=1 / math.sqrt(d),
                                  dtype="float32", label=label)
    if deterministic:
        again, _ = _run_bwd(inputs, "float32", causal=causal, kernel="tensorcore",
                            deterministic=True)
        for name, a, b in zip(("dq", "dk", "dv"), grads, again):
            assert bool(cp.all(a.view(cp.uint8) == b.view(cp.uint8))), f"{label}: {name} differs"


@pytest.mark.parametrize("causal", [False, True])
def test_f32_tensorcore_backward_strided_mqa_deterministic(causal):
    """(B, S, H, D) float32 buffers as (B, H, S, D) views, k and v one shared head (MQA: dk, dv
    summed over 4 query heads), outputs strided views too (NaN-poisoned); both dq modes against
    float64; deterministic: bitwise the same on a second call and for batch entry 1 alone."""
    cp = cupy()
    rng = _rng("f32tcbshd", causal)
    B, S, Sk, H, D = 2, 300, 257, 4, 64
    shapes = [(B, S, H, D), (B, Sk, 1, D), (B, Sk, 1, D), (B, S, H, D)]
    x = [rng.standard_normal(sh).astype(np.float32).astype(np.float64) for sh in shapes]
    g = [cp.asarray(a.astype(np.float32)).transpose(0, 2, 1, 3) for a in x]
    assert not g[0].flags.c_contiguous
    o, lse = cuflash.attention(*g[:3], causal=causal, return_lse=True)
    q, k, v, do = (a.transpose(0, 2, 1, 3) for a in x)
    ref = grad_reference(do, q, k, v, causal=causal, scale=None, dtype="float32")
    results = {}
    for det in (False, True):
        outs = [poisoned(sh, "float32").transpose(0, 2, 1, 3) for sh in shapes[:3]]
        label = cuflash.backward_dispatch_info(g[3], *g[:3], o, lse, causal=causal,
                                               deterministic=det, kernel="tensorcore")
        _f32_tc_label_ok(label, det)
        res = cuflash.attention_backward(g[3], *g[:3], o, lse, causal=causal, out=tuple(outs),
                                         deterministic=det, kernel="tensorcore")
        assert all(r is b for r, b in zip(res, outs))
        cp.cuda.get_current_stream().synchronize()
        check_grads_against_reference(outs, do, q, k, v, causal=causal, scale=None,
                                      dtype="float32", ref=ref, label=f"bshd {label}")
        results[det] = outs
    again = cuflash.attention_backward(g[3], *g[:3], o, lse, causal=causal, deterministic=True,
                                       kernel="tensorcore")
    one = cuflash.attention_backward(g[3][1:], g[0][1:], g[1][1:], g[2][1:], o[1:], lse[1:],
                                     causal=causal, deterministic=True, kernel="tensorcore")
    for name, a, b, c in zip(("dq", "dk", "dv"), results[True], again, one):
        assert bool(cp.all(a == b)), f"{name} differs between two deterministic calls"
        assert bool(cp.all(a[1:] == c)), f"{name} of batch entry 1 depends on the batch size"


@pytest.mark.parametrize("case", ["peaked", "q-tiny-k-huge", "v-tiny-do-huge"])
def test_f32_tensorcore_backward_magnitudes(case):
    """The split's per-tile powers of two far from 1: peaked rows (std-3 q and k, scale 1),
    q 2^-40 with k 2^40 (the same scores), v 1e-20 with do 1e15; causal, Sq != Sk."""
    rng = _rng("f32tcmag", case)
    q, k, v, do = random_backward_inputs(rng, (2,), (2,), 200, 333, 64, 64, "float32")
    scale = None
    if case == "peaked":
        q, k, scale = reference.round_to(3 * q, "float32"), reference.round_to(3 * k, "float32"), 1.0
    elif case == "q-tiny-k-huge":
        q, k = q * 2.0 ** -40, k * 2.0 ** 40
    else:
        v, do = reference.round_to(v * 1e-20, "float32"), reference.round_to(do * 1e15, "float32")
    inputs = _gpu_inputs(q, k, v, do, "float32", causal=True, scale=scale)
    grads, label = _run_bwd(inputs, "float32", causal=True, scale=scale, kernel="tensorcore")
    _f32_tc_label_ok(label, False)
    check_grads_against_reference(grads, do, q, k, v, causal=True,
                                  scale=scale if scale else 1 / 8, dtype="float32", label=label)


def test_f32_tensorcore_backward_dispatch(monkeypatch):
    """kernel="auto" takes the float32 tensor-core backward only with TC_BWD_F32_AUTO and Sq >=
    TC_BWD_F32_MIN_SQ; kernel="tensorcore" refuses what it does not take (D > 64, D % 8), saying
    why."""
    cp = cupy()
    from cuflash import _dispatch

    rng = _rng("f32tcdisp")
    y = cp.asarray(rng.standard_normal((2, _dispatch.TC_BWD_F32_MIN_SQ, 64)).astype(np.float32))
    o, lse = cuflash.attention(y, y, y, return_lse=True)
    monkeypatch.setattr(_dispatch, "TC_BWD_F32_AUTO", False)
    assert cuflash.backward_dispatch_info(o, y, y, y, o, lse).startswith("generic-bwd")
    monkeypatch.setattr(_dispatch, "TC_BWD_F32_AUTO", True)
    info = cuflash.backward_dispatch_info(o, y, y, y, o, lse)
    assert info.startswith("tensorcore-bwd<float32,3xfp16,D64,"), info
    short = y[:, 1:]  # fewer rows than TC_BWD_F32_MIN_SQ: generic under auto, with the reason
    o, lse = cuflash.attention(short, y, y, return_lse=True)
    info = cuflash.backward_dispatch_info(o, short, y, y, o, lse)
    assert info.startswith("generic-bwd") and "Sq >=" in info, info
    with pytest.raises(ValueError, match="Sq >="):   # and refused when demanded
        cuflash.attention_backward(o, short, y, y, o, lse, kernel="tensorcore")
    for d, why in ((128, "up to 64"), (36, "multiple of 8")):
        z = cp.asarray(rng.standard_normal((2, 50, d)).astype(np.float32))
        o, lse = cuflash.attention(z, z, z, return_lse=True)
        with pytest.raises(ValueError, match=why):
            cuflash.attention_backward(o, z, z, z, o, lse, kernel="tensorcore")
        assert cuflash.backward_dispatch_info(o, z, z, z, o, lse).startswith("generic-bwd")
