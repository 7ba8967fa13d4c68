"""The examples that need no GPU run as they are (the GPU ones are skipped without a GPU)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import GPU, NO_GPU_REASON

ROOT = Path(__file__).resolve().parent.parent
CPU_EXAMPLES = ["worked_example.py", "cpu_path.py", "gradients.py"]
GPU_EXAMPLES = ["cupy_basic.py", "dlpack_interop.py"]


def _run(name):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run([sys.executable, str(ROOT / "examples" / name)], capture_output=True,
                         text=True, env=env, timeout=300)
    assert res.returncode == 0, f"{name} failed:\n{res.stdout}\n{res.stderr}"
    return res.stdout


def test_worked_example_prints_the_documented_numbers():
    out = _run("worked_example.py")
    assert "1.0013708" in out or "1.00137" in out
    assert "2.993307" in out


def test_cpu_path_example():
    _run("cpu_path.py")


def test_gradients_example():
    """Runs on the GPU when there is one, else on the NumPy path; exits 1 on a FAIL."""
    out = _run("gradients.py")
    assert "dk (2, 1, 256, 64)" in out and "FAIL" not in out


def test_jax_transformer_example_trains():
    """cuflash.jax.attention inside a jitted training step (the NumPy path on a CPU)."""
    pytest.importorskip("jax", reason="JAX is not installed (pip install 'cuflash[jax]')")
    out = _run("jax_transformer.py")
    assert "went down" in out


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason=NO_GPU_REASON)
@pytest.mark.parametrize("name", GPU_EXAMPLES)
def test_gpu_examples(name):
    _run(name)
