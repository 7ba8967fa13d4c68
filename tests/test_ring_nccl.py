"""Ring attention over NCCL, one process per GPU (`python -m cuflash.ring.selftest -n N`):
every case against float64 (tests nothing without 2 or more GPUs and CuPy's NCCL; skipped with
the reason)."""
import os
import subprocess
import sys

import pytest

import cuflash

pytestmark = pytest.mark.gpu


def _gpus():
    if not cuflash.gpu_available():
        return 0
    import cupy

    return cupy.cuda.runtime.getDeviceCount()


def _nccl_available():
    try:
        from cupy.cuda import nccl

        return bool(nccl.available)
    except Exception:
        return False


@pytest.mark.parametrize("n", [2, 4, 8])
def test_selftest_over_nccl(n):
    if _gpus() < n:
        pytest.skip(f"needs {n} GPUs for {n} ranks; {_gpus()} visible")
    if not _nccl_available():
        pytest.skip("CuPy cannot load NCCL (pip install '.[nccl]')")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run([sys.executable, "-m", "cuflash.ring.selftest", "-n", str(n),
                          "--quick"], env=env, capture_output=True, text=True, timeout=900)
    print(res.stdout, res.stderr)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    assert "0 of" in res.stdout
