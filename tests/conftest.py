"""Shared test configuration.

GPU tests carry the ``gpu`` marker and skip, with the reason shown in pytest's summary (``-rs``),
when CuPy or a CUDA device is missing. The NVRTC compile check needs no GPU and always runs.
"""
import os

import pytest

import cuflash

# JAX (tests/test_jax.py, the audit's JAX peer) would otherwise take 75% of the GPU's memory when
# its backend starts, leaving CuPy's pool, and so every other GPU test, the rest.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

GPU = cuflash.gpu_available()


def pytest_report_header(config):
    from seeds import SEED

    return f"cuflash test seed: {SEED} (CUFLASH_TEST_SEED={SEED} reruns these inputs)"

NO_GPU_REASON = "no CUDA GPU visible to CuPy (or CuPy not installed): GPU tests skipped"

#: ptxas reports collected by tests/test_compile.py, printed at the end of the session.
COMPILE_REPORTS = []

#: Schedules of the Hopper kernel that tests/test_gpu.py forces (and tests/test_compile.py
#: compiles): (overlapped softmax, ping-pong between consumers, consumer warpgroups, Q buffers).
#: Three consumers (BM = 192) only fit the registers at head dim 64, so larger head dims keep
#: two; two Q buffers are used where they fit in shared memory.
HOPPER_SCHEDULES = [(False, False, 2, 1), (True, False, 2, 1), (False, True, 2, 1),
                    (True, True, 2, 1), (True, True, 3, 1), (False, True, 3, 2)]
SMEM_LIMIT = 227 * 1024  # shared memory per block on compute capability 9.0


def hopper_schedule_table(table, overlap, pingpong, consumers, q_stages, persistent):
    """`_dispatch.HOPPER_TABLE` with one schedule and launch applied to every entry (each keeps
    its BN)."""
    out = {}
    for key, (t, _) in table.items():
        dpad = key[0]
        t = t._replace(overlap=overlap, pingpong=pingpong,
                       consumers=consumers if dpad <= 64 else 2, q_stages=q_stages)
        if t.smem_bytes(dpad) > SMEM_LIMIT:
            t = t._replace(q_stages=1)
        out[key] = (t, persistent)
    return out


@pytest.fixture(autouse=True)
def _fresh_call_cache():
    """Each test starts without recorded call signatures (cuflash/_callcache.py): tests that
    swap dispatch tables must see their own plans."""
    from cuflash import _callcache

    _callcache.clear()
    yield


def pytest_collection_modifyitems(config, items):
    if GPU:
        return
    skip = pytest.mark.skip(reason=NO_GPU_REASON)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter):
    if not COMPILE_REPORTS:
        return
    from cuflash import _compile

    major, minor = _compile.nvrtc_version()
    terminalreporter.section(f"kernel specialisations (ptxas resource report, NVRTC {major}.{minor})")
    for rep in sorted(COMPILE_REPORTS, key=lambda r: (r.arch, r.name)):
        terminalreporter.write_line(rep.summary())
