"""The JAX ring (cuflash.ring.jax_ring: shard_map + ppermute) on 4 simulated host devices,
forward and jax.grad gradients against float64. Skipped when JAX is not installed (it is an
optional extra; CI does not install it)."""
import importlib.util
import os
import subprocess
import sys

import pytest

HAVE_JAX = importlib.util.find_spec("jax") is not None


@pytest.mark.skipif(not HAVE_JAX, reason="JAX not installed (optional): the JAX ring untested")
def test_jax_ring_on_four_host_devices():
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4",
               JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([os.path.dirname(here), os.environ.get("PYTHONPATH",
                                                                                 "")]))
    res = subprocess.run([sys.executable, os.path.join(here, "ring_jax_check.py")], env=env,
                         capture_output=True, text=True, timeout=600)
    print(res.stdout, res.stderr[-3000:])
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    assert res.stdout.count("PASS") == 6


@pytest.mark.skipif(not HAVE_JAX, reason="JAX not installed (optional): the JAX ring untested")
def test_jax_ring_merge_weights_do_not_depend_on_the_lse_magnitude():
    """The JAX ring's merge of partials whose lse lie near L: the exact merge depends on
    lse_a - lse_b only. Weights exp(lse_a - logaddexp(lse_a, lse_b)) carried the merged lse's
    float32 rounding, an error of about u |L| in every output (1e-3 at L = 1e4); they are
    normalised from the difference now, as in cuflash.merge_states."""
    import numpy as np
    from scipy.special import expit

    from cuflash.ring import jax_ring
    from seeds import SEED, case_rng

    rng = case_rng(SEED, "jax-ring-merge")
    for big in (0.0, 1e2, 1e4):
        o_a, o_b = (rng.standard_normal((3, 40, 8)).astype(np.float32) for _ in range(2))
        la, lb = ((big + rng.standard_normal((3, 40))).astype(np.float32) for _ in range(2))
        o, lse = (np.asarray(x, np.float64) for x in jax_ring.merge(o_a, la, o_b, lb))
        wa = expit(la.astype(np.float64) - lb)   # exact for float32 lse values, in float64
        exact = wa[..., None] * o_a + (1 - wa)[..., None] * o_b
        scale = np.abs(o_a).max() + np.abs(o_b).max()
        assert np.abs(o - exact).max() <= 8 * 2.0**-24 * scale, big
        lse_exact = np.maximum(la, lb).astype(np.float64) + np.log1p(
            np.exp(-np.abs(la.astype(np.float64) - lb)))
        assert np.abs(lse - lse_exact).max() <= 4 * 2.0**-24 * (1 + np.abs(lse_exact).max()), big
