"""GPU tests of ring attention with every rank's shard on one GPU (`LocalGPUTransport`: the
schedule's shifts as device-to-device copies on a second stream, ordered by events): forward
and backward against the float64 references under the project's pass rules, with 1 to 8
ranks, causal and not, tails that 2R does not divide, strided inputs, a user stream. Skipped
without a GPU."""
import numpy as np
import pytest

from cuflash import ring

from gpu_util import (check_against_reference, check_grads_against_reference, cupy,
                      random_backward_inputs, random_inputs, seeded_rng, skip_unsupported_dtype,
                      to_gpu)

pytestmark = pytest.mark.gpu

from seeds import SEED  # noqa: E402  (fresh every run; see pytest's header)


def _rng(*key):
    return seeded_rng(SEED, *key)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("world", [1, 2, 3, 8])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("s,d", [(1000, 128), (113, 64)])
def test_forward_one_gpu(dtype, world, causal, s, d):
    skip_unsupported_dtype(dtype)
    print("seed", SEED)
    rng = _rng(dtype, world, causal, s, d)
    q, k, v = random_inputs(rng, (2, 4), (2, 4), s, s, d, d, dtype)
    qg, kg, vg = (to_gpu(x, dtype) for x in (q, k, v))
    o, lse = ring.ring_attention_local(qg, kg, vg, world=world, causal=causal, return_lse=True)
    cupy().cuda.get_current_stream().synchronize()
    check_against_reference(o, lse, q, k, v, causal=causal, scale=None, dtype=dtype)


@pytest.mark.parametrize("world,s", [(1, 2), (1, 7), (3, 6), (3, 7), (8, 16), (8, 113)])
def test_forward_one_gpu_short(world, s):
    """The shortest sequences (S = 2R: one row per chunk) and tails, causal and not."""
    for causal in (False, True):
        rng = _rng("short", world, s, causal)
        q, k, v = random_inputs(rng, (3,), (3,), s, s, 64, 64, "float16")
        qg, kg, vg = (to_gpu(x, "float16") for x in (q, k, v))
        o, lse = ring.ring_attention_local(qg, kg, vg, world=world, causal=causal,
                                           return_lse=True)
        cupy().cuda.get_current_stream().synchronize()
        check_against_reference(o, lse, q, k, v, causal=causal, scale=None, dtype="float16")


@pytest.mark.parametrize("causal", [False, True])
def test_forward_strided_shared_head_user_stream(causal):
    """A (B, S, H, D) buffer passed as its (B, H, S, D) view, one key/value head for four query
    heads, D != Dv, a scale, on a non-default stream."""
    cp = cupy()
    dtype, world, s = "float16", 4, 1000
    rng = _rng("strided", causal)
    q, k, v = random_inputs(rng, (2, 4), (2, 1), s, s, 64, 32, dtype)
    qg = to_gpu(np.ascontiguousarray(np.swapaxes(q, 1, 2)), dtype).swapaxes(1, 2)
    kg, vg = to_gpu(k, dtype), to_gpu(v, dtype)
    cp.cuda.Device().synchronize()  # the inputs were made on the default stream
    stream = cp.cuda.Stream(non_blocking=True)
    o, lse = ring.ring_attention_local(qg, kg, vg, world=world, causal=causal, scale=0.2,
                                       return_lse=True, stream=stream)
    stream.synchronize()
    check_against_reference(o, lse, q, k, v, causal=causal, scale=0.2, dtype=dtype)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("world", [2, 3, 8])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("s", [1000, 113])
def test_backward_one_gpu(dtype, world, causal, s):
    skip_unsupported_dtype(dtype)
    print("seed", SEED)
    rng = _rng("bwd", dtype, world, causal, s)
    q, k, v, do = random_backward_inputs(rng, (2, 2), (2, 2), s, s, 64, 64, dtype)
    qg, kg, vg, dog = (to_gpu(x, dtype) for x in (q, k, v, do))
    o, lse = ring.ring_attention_local(qg, kg, vg, world=world, causal=causal, return_lse=True)
    grads = ring.ring_attention_backward_local(dog, qg, kg, vg, o, lse, world=world,
                                               causal=causal)
    cupy().cuda.get_current_stream().synchronize()
    check_grads_against_reference(grads, do, q, k, v, causal=causal, scale=None, dtype=dtype,
                                  label=f"ring world={world}")


def test_world_one_and_null_transport():
    """world=1 (one rank: a causal call per half, merged) passes the rule at a longer S, and
    the NullTransport (the benchmark's compute-only ring: the same calls, no transfers) runs."""
    cp = cupy()
    dtype, s = "float16", 4096
    rng = _rng("null")
    q, k, v = random_inputs(rng, (1, 2), (1, 2), s, s, 128, 128, dtype)
    qg, kg, vg = (to_gpu(x, dtype) for x in (q, k, v))
    o1 = ring.ring_attention_local(qg, kg, vg, world=1, causal=True)
    check_against_reference(o1, None, q, k, v, causal=True, scale=None, dtype=dtype)
    world = 4
    sh = [ring.shard(x, world=world, rank=2) for x in (qg, kg, vg)]
    o, lse = ring.ring_attention(*sh, transport=ring.NullTransport(world, rank=2), causal=True,
                                 return_lse=True)
    cp.cuda.get_current_stream().synchronize()
    assert o.shape == sh[0].shape and bool(cp.isfinite(lse).all())
