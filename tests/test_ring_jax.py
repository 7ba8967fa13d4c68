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
