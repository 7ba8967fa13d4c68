"""GPU tests of the Hopper backward with a variant's policy (attn_bwd_wgmma.cu:
cuflash_bwd_wgmma_var, _dispatch_variants.HOPPER_BWD_VARIANTS on for these tests): the Hopper
forward with the variant, then the backward from its o and lse on the Hopper backward
(kernel="hopper", asserted through backward_dispatch_info), dq, dk, dv (and dbias with a bias)
into NaN-poisoned buffers against the float64 reference gradients under
reference.grad_pass_threshold (gpu_util.check_variant_case; deterministic: a second run equal bit
for bit). D = 128: softcap, ALiBi ((H,) and per batch entry (B, H) slopes, which rebind per
reduction step), windows of several reaches (query tiles and key blocks skipped on both sides,
the causal intersection, deterministic turns over the visited key blocks) and the positional
parts combined; D = 256: a bias (dbias), a boolean mask with rows that see no key, all five
parts. Tails (Sq, Sk in 1, 7, 113, 1000), Sq != Sk both ways, k and v broadcast over the leading
batch axis. Needs compute capability 9.0; skipped without a GPU."""
import numpy as np
import pytest

from cuflash import _dispatch_variants

from gpu_util import cupy
from seeds import SEED, case_rng
from test_variants_gpu import BATCH_Q, _run_case

pytestmark = pytest.mark.gpu

SHAPES = [(7, 7), (113, 1000), (1000, 113), (1, 40)]


@pytest.fixture(autouse=True)
def hopper_bwd_variants(monkeypatch):
    cp = cupy()
    if cp.cuda.Device().compute_capability != "90":
        pytest.skip("the Hopper backward runs on compute capability 9.0")
    monkeypatch.setattr(_dispatch_variants, "HOPPER_BWD_VARIANTS", True)


def _kw(name, sq, sk):
    rng = case_rng(SEED, "hopper-bwd-kw", name, sq, sk)
    h = BATCH_Q[-1]
    slopes = rng.uniform(0.01, 0.3, (h,)).astype(np.float32)
    return {
        "softcap": dict(softcap=2.0),
        "softcap-large": dict(softcap=30.0),
        "alibi": dict(alibi_slopes=slopes),
        "window": dict(window=(17, 3)),
        "positional": dict(window=(40, 5), softcap=1.5,
                           alibi_slopes=rng.uniform(0.01, 0.3, BATCH_Q).astype(np.float32)),
    }[name]


@pytest.mark.parametrize("sq,sk", SHAPES)
@pytest.mark.parametrize("det", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", ["softcap", "alibi", "window", "positional"])
def test_hopper_backward_d128(name, causal, det, sq, sk):
    _run_case(f"hopper-bwd-{name}", causal, "float16", sq, sk, "hopper", d=128,
              kw=_kw(name, sq, sk), deterministic=det, bwd_kernel="hopper")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_hopper_backward_d128_bfloat16_and_large_scores(dtype):
    _run_case("hopper-bwd-softcap-large", True, dtype, 113, 1000, "hopper", d=128,
              kw=_kw("softcap-large", 113, 1000), bwd_kernel="hopper")
    _run_case("hopper-bwd-positional", False, dtype, 1000, 113, "hopper", d=128,
              kw=_kw("positional", 1000, 113), bwd_kernel="hopper")


WINDOWS = [(0, 0), (1, 0), (16, 16), (100, 3), (-1, 33), (200, -1), (5, 10 ** 6)]


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("causal,det,sq,sk", [
    (False, True, 300, 1000), (True, True, 1000, 300), (True, False, 700, 700),
    (False, False, 113, 1000)])
def test_hopper_backward_windows(window, causal, det, sq, sk):
    _run_case(f"hopper-bwd-window{window}", causal, "float16", sq, sk, "hopper", d=128,
              kw=dict(window=window), deterministic=det, bwd_kernel="hopper")


# D = 256 (the SPLIT form): the parts that read tensors (a bias with dbias, a mask with empty
# rows) and all five; test_variants_gpu's tables of them. (Not the parts that read tensors
# without causal in deterministic mode: hopper_bwd_variant_reason refuses them there,
# test_hopper_bwd_variants_cpu.py.)
@pytest.mark.parametrize("sq,sk", [(113, 1000), (1000, 113), (7, 7)])
@pytest.mark.parametrize("name,causal,det", [
    ("bias-head", False, False), ("bias-f16-shared", True, True), ("mask-empty-rows", True, True),
    ("mask-empty-rows", False, False),
    ("combined", True, True), ("combined", False, False), ("softcap", False, True),
    ("alibi", True, True)])
def test_hopper_backward_d256(name, causal, det, sq, sk):
    _run_case(name, causal, "float16", sq, sk, "hopper", d=256, deterministic=det,
              bwd_kernel="hopper")


def test_hopper_backward_d256_bfloat16():
    _run_case("combined", True, "bfloat16", 113, 250, "hopper", d=256, bwd_kernel="hopper")
