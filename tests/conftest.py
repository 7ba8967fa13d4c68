"""Shared test configuration.

GPU tests carry the ``gpu`` marker and skip, with the reason shown in pytest's summary (``-rs``),
when CuPy or a CUDA device is missing. The NVRTC compile check needs no GPU and always runs.
"""
import pytest

import cuflash

GPU = cuflash.gpu_available()
NO_GPU_REASON = "no CUDA GPU visible to CuPy (or CuPy not installed): GPU tests skipped"

#: ptxas reports collected by tests/test_compile.py, printed at the end of the session.
COMPILE_REPORTS = []


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
    terminalreporter.section("kernel specialisations (ptxas resource report)")
    for rep in sorted(COMPILE_REPORTS, key=lambda r: (r.arch, r.name)):
        terminalreporter.write_line(rep.summary())
