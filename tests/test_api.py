"""The public API's argument checks (CPU, no GPU needed): every bad input gets a TypeError or
ValueError that names the argument and what was expected; good inputs of every accepted form run."""
import numpy as np
import pytest

import cuflash
from cuflash import reference

RNG = np.random.default_rng()


def arr(*shape, dtype=np.float32):
    return RNG.standard_normal(shape).astype(dtype)


Q, K, V = arr(2, 3, 10, 16), arr(2, 3, 12, 16), arr(2, 3, 12, 8)


@pytest.mark.parametrize("args,kwargs,exc,match", [
    ((Q, K, V.astype(np.float64)), {}, TypeError, "same dtype"),
    ((Q.astype(np.int32), K, V), {}, TypeError, "q has dtype int32"),
    ((Q.astype(np.complex64), K, V), {}, TypeError, "expected one of"),
    ((arr(16), K, V), {}, ValueError, "at least 2 dimensions"),
    ((arr(2, 3, 0, 16), K, V), {}, ValueError, "zero-length axis"),
    ((Q, arr(2, 3, 12, 0), V), {}, ValueError, "zero-length axis"),
    ((arr(0, 3, 10, 16), K, V), {}, ValueError, "zero-length axis"),
    ((Q, arr(2, 3, 12, 15), V), {}, ValueError, "head dim 15 but q has 16"),
    ((Q, K, arr(2, 3, 11, 8)), {}, ValueError, "v has 11 keys"),
    ((arr(1, 4, 300), arr(1, 4, 300), arr(1, 4, 8)), {}, ValueError, "at most 256"),
    ((arr(1, 4, 16), arr(1, 4, 16), arr(1, 4, 257)), {}, ValueError, "at most 256"),
    ((arr(2, 10, 16), arr(3, 12, 16), arr(3, 12, 8)), {}, ValueError, "do not broadcast"),
    ((Q, K, V), {"causal": 1}, TypeError, "causal must be a bool"),
    ((Q, K, V), {"scale": float("nan")}, ValueError, "scale must be finite"),
    ((Q, K, V), {"scale": "0.1"}, TypeError, "scale must be a real number"),
    ((Q, K, V), {"out": np.empty((2, 3, 10, 16), np.float32)}, ValueError, "out has shape"),
    ((Q, K, V), {"out": np.empty((2, 3, 10, 8), np.float64)}, TypeError, "out has dtype"),
    ((Q, K, V), {"out": np.empty((2, 3, 8, 10), np.float32).swapaxes(-1, -2)}, ValueError,
     "contiguous last axis"),
    ((Q, K, V), {"kernel": "fast"}, ValueError, "kernel must be one of"),
    ((Q, K, V), {"kernel": "generic"}, ValueError, "inputs are on the CPU"),
    ((Q, K, V), {"stream": 0}, ValueError, "stream= applies to GPU inputs only"),
    (([[1.0]], K, V), {}, TypeError, "q must be a NumPy or CuPy array"),
])
def test_bad_input(args, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        cuflash.attention(*args, **kwargs)


def test_out_pair_needs_return_lse():
    o = np.empty((2, 3, 10, 8), np.float32)
    lse = np.empty((2, 3, 10), np.float32)
    with pytest.raises(ValueError, match="only with return_lse=True"):
        cuflash.attention(Q, K, V, out=(o, lse))
    with pytest.raises(TypeError, match="expected float32"):
        cuflash.attention(Q, K, V, return_lse=True, out=(o, lse.astype(np.float64)))


def test_out_is_written_and_returned():
    o = np.full((2, 3, 10, 8), np.nan, np.float32)
    lse = np.full((2, 3, 10), np.nan, np.float32)
    res = cuflash.attention(Q, K, V, causal=True, return_lse=True, out=(o, lse))
    assert res[0] is o and res[1] is lse
    o_ref, lse_ref = reference.attention_ref(Q, K, V, causal=True)
    assert np.max(np.abs(o - o_ref)) < 1e-5
    np.testing.assert_allclose(lse, lse_ref, rtol=1e-5, atol=1e-5)


def test_merge_states_bad_input():
    o = arr(3, 4)
    lse = arr(3)
    with pytest.raises(ValueError, match="same shape"):
        cuflash.merge_states(o, lse, arr(3, 5), lse)
    with pytest.raises(ValueError, match="lse_b has shape"):
        cuflash.merge_states(o, lse, o, arr(4))
    with pytest.raises(TypeError, match="lse_a has dtype float64"):
        cuflash.merge_states(o, lse.astype(np.float64), o, lse)
    with pytest.raises(TypeError, match="same dtype"):
        cuflash.merge_states(o, lse, o.astype(np.float64), lse)


def test_dispatch_info_and_gpu_available_on_cpu():
    assert cuflash.dispatch_info(Q, K, V) == "cpu-numpy"
    assert isinstance(cuflash.gpu_available(), bool)


def test_default_scale_is_inverse_sqrt_d():
    o1 = cuflash.attention(Q, K, V)
    o2 = cuflash.attention(Q, K, V, scale=1 / 4.0)
    np.testing.assert_array_equal(o1, o2)


def test_opaque_two_byte_dtype_is_explained():
    """A bfloat16 tensor that arrived without its dtype (no ml_dtypes, or through
    __cuda_array_interface__) shows up as 'V2': say what it probably is."""
    x = RNG.standard_normal((4, 8)).astype(np.float16).view("V2")
    with pytest.raises(TypeError, match="opaque 2-byte dtype"):
        cuflash.attention(x, x, x)


def test_bfloat16_on_the_cpu_path():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    bf16 = np.dtype(ml_dtypes.bfloat16)
    q, k, v = (reference.round_to(RNG.standard_normal((2, 33, 16)), "bfloat16") for _ in range(3))
    o = cuflash.attention(q.astype(bf16), k.astype(bf16), v.astype(bf16), causal=True)
    assert o.dtype == bf16
    o_ref, _ = reference.attention_ref(q, k, v, causal=True)
    rule = reference.pass_threshold(q, k, v, causal=True, dtype="bfloat16", o_ref=o_ref)
    assert rule.judge(o.astype(np.float64)).passed


def test_out_lse_must_be_c_contiguous():
    o = np.empty((2, 3, 10, 8), np.float32)
    lse = np.empty((3, 2, 10), np.float32).transpose(1, 0, 2)
    with pytest.raises(ValueError, match="C-contiguous"):
        cuflash.attention(Q, K, V, return_lse=True, out=(o, lse))


def test_merge_states_stream_is_gpu_only():
    o, lse = arr(3, 4), arr(3)
    with pytest.raises(ValueError, match="stream= applies to GPU inputs only"):
        cuflash.merge_states(o, lse, o, lse, stream=0)


def test_precision_argument_is_checked():
    """precision: None, "default", "highest", "high" (any case, or an enum member with such a
    name, as jax.lax.Precision); anything else is a ValueError naming the accepted values."""
    import enum

    import cuflash

    rng = np.random.default_rng(7)
    q = rng.standard_normal((2, 5, 8)).astype(np.float32)
    o_default = cuflash.attention(q, q, q)

    class Precision(enum.Enum):  # the shape of jax.lax.Precision
        DEFAULT = 0
        HIGH = 1
        HIGHEST = 2

    for p in (None, "default", "highest", "HIGH", "High", Precision.HIGHEST, Precision.HIGH):
        # The NumPy path computes in full float32 whatever is asked (precision is a floor).
        np.testing.assert_array_equal(cuflash.attention(q, q, q, precision=p), o_default)
    for bad in ("medium", "fp32", 3, Precision):
        with pytest.raises(ValueError, match="precision must be one of"):
            cuflash.attention(q, q, q, precision=bad)
    assert cuflash.dispatch_info(q, q, q, precision="high") == "cpu-numpy"


def test_size_zero_axes_are_refused_by_every_entry_point():
    """Empty problems: a size-0 axis (B, H, Sq, Sk, D, total rows) is a ValueError naming the
    array on every entry point (README, "Errors"); empty sequences are lengths instead."""
    z = np.zeros
    q, k, v = arr(2, 3, 10, 16), arr(2, 3, 12, 16), arr(2, 3, 12, 8)
    o, lse = cuflash.attention(q, k, v, return_lse=True)
    for args in ((z((2, 3, 0, 16), np.float32), k, v), (q, z((2, 3, 0, 16), np.float32), v),
                 (z((0, 3, 10, 16), np.float32), k, v), (q, k, z((2, 3, 12, 0), np.float32))):
        with pytest.raises(ValueError, match="zero-length axis"):
            cuflash.attention(*args)
        with pytest.raises(ValueError, match="zero-length axis"):
            cuflash.attention_backward(o, *args, o, lse)
    with pytest.raises(ValueError, match="zero-length axis"):
        cuflash.merge_states(z((0, 4), np.float32), z(0, np.float32), z((0, 4), np.float32),
                             z(0, np.float32))
    cu = np.array([0, 0], np.int32)
    vq = z((0, 2, 16), np.float32)
    with pytest.raises(ValueError, match="zero-length axis"):
        cuflash.attention_varlen(vq, vq, vq, cu, cu, 1, 1)
    with pytest.raises(ValueError, match="zero-length axis"):
        cuflash.attention_with_kvcache(z((2, 0, 2, 16), np.float32), arr(2, 8, 2, 16),
                                       arr(2, 8, 2, 16), np.array([1, 2], np.int32))
