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


def _run_case(name, causal, dtype, sq, sk, kernel, d=64, kw=None, deterministic=False):
    if dtype == "bfloat16" and bf16_dtype() is None:
        pytest.skip("bfloat16 on the GPU needs ml_dtypes")
    rng = _rng(name, causal, dtype, sq, sk, kernel, d, deterministic)
    q, k, v = random_inputs(rng, BATCH_Q, BATCH_KV, sq, sk, d, d, dtype)
    kw = _host_variant(name, rng, sq, sk, dtype) if kw is None else kw
    dkw = _to_device(kw)
    qg, kg, vg = (to_gpu(x, dtype) for x in (q, k, v))
    return check_variant_case(q, k, v, qg, kg, vg, kw, dkw, causal=causal, dtype=dtype,
                              rng=rng, seed=SEED, kernel=kernel, deterministic=deterministic)


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


def test_variant_backward_dispatch():
    """kernel="auto" takes the tensor-core backward for a float16 variant (the label names its
    parts); float32 falls back to the generic one and backward_dispatch_info says why;
    kernel="tensorcore" then raises naming the variant."""
    cp = cupy()
    q = cp.ones((1, 2, 64, 64), dtype=cp.float16)
    lse = cp.zeros((1, 2, 64), dtype=cp.float32)
    label = cuflash.backward_dispatch_info(q, q, q, q, q, lse, window=(8, 0), softcap=3.0)
    assert label.startswith("tensorcore-bwd<float16,D64,") and \
        label.endswith(",full,window,softcap>"), label
    q32 = q.astype(cp.float32)
    label = cuflash.backward_dispatch_info(q32, q32, q32, q32, q32, lse, window=(8, 0))
    assert label.startswith("generic-bwd<float32,") and \
        "(tensor-core backward not used: it takes float16" in label, label
    with pytest.raises(ValueError, match=r"kernel='tensorcore' cannot run this backward with "
                                         r"the attention variant \(window\)"):
        cuflash.attention_backward(q32, q32, q32, q32, q32, lse, window=(8, 0),
                                   kernel="tensorcore")


def test_variant_dispatch():
    """kernel="auto" takes the mma.sync kernel for a variant (on sm_90 too: not the Hopper
    kernel), names the variant in the label; "hopper" refuses; float64 and D > 256 fall back to
    the generic kernel and say why; "tensorcore" then raises."""
    cp = cupy()
    q = cp.ones((1, 2, 64, 64), dtype=cp.float16)
    label = cuflash.dispatch_info(q, q, q, window=(8, 0))
    assert label.startswith("tensorcore<float16,D64,") and label.endswith(",full,window>"), label
    assert cuflash.dispatch_info(q, q, q, softcap=3.0, causal=True).endswith(",causal,softcap>")
    with pytest.raises(ValueError, match="variant"):
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
