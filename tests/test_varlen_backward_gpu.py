"""GPU tests of attention_varlen_backward: the generic and tensor-core backward kernels' varlen
forms against the float64 reference per sequence under the gradient pass rule
(reference.grad_pass_threshold), float16, bfloat16, float32 and float64, on fresh random packed
batches with ragged lengths (1, 7, 113, 1000, empty sequences on either side, Sq != Sk),
causal on and off, grouped heads, strided views, max_seqlen upper bounds, dq/dk/dv and the
workspace poisoned with NaN, a side stream, and bitwise determinism (also against the same
sequence launched alone: another grid, the same bits). Skipped without a GPU."""
import numpy as np
import pytest

import cuflash

from gpu_util import bf16_dtype, cupy, poisoned, to_gpu, to_host64
from seeds import SEED, case_rng
from varlen_util import check_varlen_grads, make_varlen

pytestmark = pytest.mark.gpu

DTYPES = ["float16", "bfloat16", "float32", "float64"]
CASES = [  # (H, Hkv, D, lens_q, lens_k)
    (4, 4, 64, (1, 7, 113, 1000), (1, 7, 113, 1000)),
    (8, 2, 128, (1, 300, 0, 57), (64, 300, 7, 0)),       # Sq != Sk; no queries; no keys
    (4, 1, 40, (113, 1, 33), (7, 1000, 70)),             # MQA, padded head dim
]


def _rng(*key):
    return case_rng(SEED, "varlen-bwd-gpu", *key)


def _skip(dtype, kernel, d):
    if dtype == "bfloat16" and bf16_dtype() is None:
        pytest.skip("bfloat16 on the GPU needs ml_dtypes (CuPy's bfloat16 dtype)")
    if kernel == "tensorcore":
        from cuflash import _dispatch

        if int(cupy().cuda.Device().compute_capability) < 80:
            pytest.skip("the tensor-core backward needs compute capability 8.0")
        if dtype not in _dispatch.TC_BWD_DTYPES or d % 8 or d > max(_dispatch.TC_BWD_CONFIGS):
            pytest.skip(f"the tensor-core backward does not take {dtype}, D={d}")


def _inputs(rng, h, hkv, d, lens_q, lens_k, dtype, causal):
    """float64 q, k, v, do, offsets, and the GPU arrays with the forward's o and lse: from the GPU
    forward for float16/bfloat16 (the round trip a user runs), else from the CPU forward (the GPU
    varlen forward takes 16-bit inputs only)."""
    cp = cupy()
    q, k, v, cu_q, cu_k = make_varlen(rng, np.array(lens_q), np.array(lens_k), h, hkv, d, dtype)
    g = [to_gpu(x, dtype) for x in (q, k, v)]
    mq, mk = max(1, max(lens_q)), max(1, max(lens_k))
    if dtype in ("float16", "bfloat16") and int(cp.cuda.Device().compute_capability) >= 80:
        o, lse = cuflash.attention_varlen(*g, cp.asarray(cu_q), cp.asarray(cu_k), mq, mk,
                                          causal=causal, return_lse=True)
    else:
        o, lse = cuflash.attention_varlen(*(x.astype(dtype) for x in (q, k, v)), cu_q, cu_k, mq,
                                          mk, causal=causal, return_lse=True)
        o, lse = to_gpu(o.astype(np.float64), dtype), cp.asarray(lse)
    do = reference_round(rng.standard_normal(o.shape), dtype)
    return (q, k, v, do, cu_q, cu_k, mq, mk), (to_gpu(do, dtype), *g, o, lse,
                                               cp.asarray(cu_q), cp.asarray(cu_k))


def reference_round(x, dtype):
    from cuflash import reference

    return reference.round_to(x, dtype)


def _run(gpu, mq, mk, dtype, *, causal, kernel, deterministic=False, workspace=None,
         stream=None):
    """Backward into NaN-poisoned dq, dk, dv; returns them after the stream finished."""
    cp = cupy()
    do, q, k, v, o, lse, cu_q, cu_k = gpu
    out = tuple(poisoned(x.shape, dtype) for x in (q, k, v))
    res = cuflash.attention_varlen_backward(do, q, k, v, o, lse, cu_q, cu_k, mq, mk,
                                            causal=causal, kernel=kernel, out=out,
                                            deterministic=deterministic, workspace=workspace,
                                            stream=stream)
    assert all(a is b for a, b in zip(res, out))
    (stream or cp.cuda.get_current_stream()).synchronize()
    return res


@pytest.mark.parametrize("kernel", ["generic", "tensorcore"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=["tails", "gqa-empty", "mqa-d40"])
def test_varlen_backward_gpu(case, dtype, causal, kernel):
    h, hkv, d, lens_q, lens_k = case
    _skip(dtype, kernel, d)
    host, gpu = _inputs(_rng("ref", case, dtype, causal), h, hkv, d, lens_q, lens_k, dtype,
                        causal)
    q, k, v, do, cu_q, cu_k, mq, mk = host
    label = cuflash.varlen_backward_dispatch_info(*gpu[:6], *gpu[6:], mq, mk, causal=causal,
                                                  kernel=kernel)
    assert label.startswith("varlen-" + ("tensorcore" if kernel == "tensorcore" else "generic"))
    grads = [to_host64(x) for x in _run(gpu, mq, mk, dtype, causal=causal, kernel=kernel)]
    check_varlen_grads(grads, do, q, k, v, cu_q, cu_k, causal=causal, dtype=dtype)


@pytest.mark.parametrize("kernel", ["generic", "tensorcore"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_varlen_backward_deterministic_bitwise(dtype, kernel):
    """deterministic=True: repeated calls give the same bits, and each sequence's gradients are
    the bits of that sequence launched alone (another grid, another max_seqlen)."""
    cp = cupy()
    _skip(dtype, kernel, 128)
    lens_q, lens_k = (300, 1, 517), (517, 9, 300)
    host, gpu = _inputs(_rng("det", dtype, kernel), 8, 2, 128, lens_q, lens_k, dtype, True)
    q, k, v, do, cu_q, cu_k, mq, mk = host
    first = _run(gpu, mq, mk, dtype, causal=True, kernel=kernel, deterministic=True)
    for _ in range(2):
        again = _run(gpu, mq, mk, dtype, causal=True, kernel=kernel, deterministic=True)
        for name, a, b in zip(("dq", "dk", "dv"), first, again):
            assert bool(cp.all(a.view(cp.uint8) == b.view(cp.uint8))), f"{name} differs"
    dog, qg, kg, vg, o, lse = gpu[:6]
    for s in range(len(lens_q)):
        q0, q1, k0, k1 = (int(x) for x in (cu_q[s], cu_q[s + 1], cu_k[s], cu_k[s + 1]))
        one_q, one_k = cp.asarray([0, q1 - q0], np.int32), cp.asarray([0, k1 - k0], np.int32)
        alone = _run((dog[q0:q1], qg[q0:q1], kg[k0:k1], vg[k0:k1], o[q0:q1],
                      cp.ascontiguousarray(lse[:, q0:q1]), one_q, one_k),
                     q1 - q0, k1 - k0, dtype, causal=True, kernel=kernel, deterministic=True)
        for name, a, b in zip(("dq", "dk", "dv"), alone,
                              (first[0][q0:q1], first[1][k0:k1], first[2][k0:k1])):
            assert bool(cp.all(a.view(cp.uint8) == b.view(cp.uint8))), \
                f"sequence {s}: {name} alone differs from {name} in the batch"
    check_varlen_grads([to_host64(x) for x in first], do, q, k, v, cu_q, cu_k, causal=True,
                       dtype=dtype)


@pytest.mark.parametrize("kernel", ["generic", "tensorcore"])
def test_varlen_backward_strided_bounds_workspace_stream(kernel):
    """Strided q, k, v, do, o (head axis every other head of a wider buffer) and lse (a
    transposed view), max_seqlen larger than every sequence, a NaN-poisoned workspace of the
    queried size, a side stream: the same pass rule."""
    cp = cupy()
    dtype, h, hkv, d = "float16", 4, 2, 64
    _skip(dtype, kernel, d)
    host, gpu = _inputs(_rng("strided", kernel), h, hkv, d, (7, 0, 113), (113, 5, 1), dtype,
                        False)
    q, k, v, do, cu_q, cu_k, mq, mk = host

    def view(x):
        big = cp.full((x.shape[0], 2 * x.shape[1], x.shape[2]), cp.nan, dtype=x.dtype)
        big[:, ::2] = x
        return big[:, ::2]

    lse_t = cp.full(gpu[5].shape[::-1], cp.nan, dtype=cp.float32).T
    lse_t[...] = gpu[5]
    sgpu = (*(view(x) for x in gpu[:5]), lse_t, *gpu[6:])
    args = (*sgpu[:6], *sgpu[6:], mq + 40, mk + 17)
    need = cuflash.attention_varlen_backward_workspace_size(*args, kernel=kernel)
    assert need > 0
    ws = cp.empty(need, dtype=cp.uint8)
    ws.fill(0xFF)
    stream = cp.cuda.Stream(non_blocking=True)
    grads = _run(sgpu, mq + 40, mk + 17, dtype, causal=False, kernel=kernel, workspace=ws,
                 stream=stream)
    check_varlen_grads([to_host64(x) for x in grads], do, q, k, v, cu_q, cu_k, causal=False,
                       dtype=dtype)
