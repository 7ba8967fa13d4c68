"""Shared test configuration.

GPU tests carry the ``gpu`` marker and skip, with the reason shown in pytest's summary (``-rs``),
when CuPy or a CUDA device is missing. The NVRTC compile check needs no GPU and always runs.
"""
import os

# One OpenBLAS kernel on every x86-64 host (read when NumPy loads OpenBLAS, so before cuflash):
# the float32 naive reference that the error rule's 2x-naive bar measures (cuflash.reference.
# naive_attention) runs through sgemm, and OpenBLAS picks its kernel by CPU. At large scores the
# choice moved that bar 26x on one draw (the AVX-512 kernel's sums the more accurate:
# test_mma_fp16split_model's D = 192, scale 2.5 case fails under it, 2026-12-02), so without a
# pin the suite's verdicts depend on the host (notes/ERROR_BOUND.md, "The naive reference's BLAS").
os.environ.setdefault("OPENBLAS_CORETYPE", "Haswell")

import pytest  # noqa: E402

import cuflash  # noqa: E402

# JAX (tests/test_jax.py, the audit's JAX peer) would otherwise take 75% of the GPU's memory when
# its backend starts, leaving CuPy's pool, and so every other GPU test, the rest.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

GPU = cuflash.gpu_available()


def pytest_report_header(config):
    from seeds import SEED

    lines = [f"cuflash test seed: {SEED} (CUFLASH_TEST_SEED={SEED} reruns these inputs)"]
    lines += [f"cuflash flag set by --cuflash-flag: {f}" for f in FLAGS_SET]
    if config.getoption("shard"):
        lines.append(f"cuflash shard {config.getoption('shard')} (interleaved)")
    return lines

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


def load_benchmark(name):
    """benchmarks/NAME.py imported as a module of its own (the scripts are not a package), for
    the CPU tests of their helpers."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"{name}_under_test", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(autouse=True)
def _fresh_call_cache():
    """Each test starts without recorded call signatures (cuflash/_callcache.py): tests that
    swap dispatch tables must see their own plans."""
    from cuflash import _callcache

    _callcache.clear()
    yield


def pytest_addoption(parser):
    group = parser.getgroup("cuflash")
    group.addoption(
        "--shard", metavar="K/N", default=None,
        help="run only the K-th of N interleaved shards of the selected tests (1 <= K <= N): the "
             "i-th selected test (collection order, after -m and -k) is in shard i % N + 1, so "
             "each shard is a cross-section of every file and a shard cut by a timeout loses a "
             "spread of cases rather than the same files' tails (benchmarks/run_gpu_suite.sh)")
    group.addoption(
        "--cuflash-flag", metavar="MODULE.NAME=VALUE", action="append", default=[],
        help="set a flag of a cuflash module for the whole session before any test runs, e.g. "
             "--cuflash-flag _decode.DECODE_VERSION=2 (VALUE is a Python literal of the flag's "
             "type), so that the whole suite can run with a flag on before it is switched on; "
             "tests that set the flag themselves still do. Repeatable")


def _parse_shard(text):
    try:
        k, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise pytest.UsageError(f"--shard expects K/N with integers, got {text!r}") from None
    if not 1 <= k <= n:
        raise pytest.UsageError(f"--shard K/N needs 1 <= K <= N, got {text!r}")
    return k, n


def _apply_flag(text):
    """`--cuflash-flag MODULE.NAME=VALUE`: checked against the flag's current value, so that a
    typo or a value of the wrong type is an error and not a silently ignored setting."""
    import ast
    import importlib

    target, sep, value = text.partition("=")
    modname, dot, name = target.strip().rpartition(".")
    if not (sep and dot and name):
        raise pytest.UsageError(f"--cuflash-flag expects MODULE.NAME=VALUE, got {text!r}")
    try:
        mod = importlib.import_module(f"cuflash.{modname}")
    except ImportError:
        raise pytest.UsageError(f"--cuflash-flag {text!r}: no module cuflash.{modname}") from None
    if not hasattr(mod, name) or not name.isupper():
        raise pytest.UsageError(f"--cuflash-flag {text!r}: cuflash.{modname} has no flag {name} "
                                "(flags are upper-case module attributes)")
    try:
        new = ast.literal_eval(value.strip())
    except (ValueError, SyntaxError):
        raise pytest.UsageError(f"--cuflash-flag {text!r}: {value!r} is not a Python literal") from None
    old = getattr(mod, name)
    if type(new) is not type(old):
        raise pytest.UsageError(f"--cuflash-flag {text!r}: cuflash.{modname}.{name} holds a "
                                f"{type(old).__name__} ({old!r}), got a {type(new).__name__}")
    setattr(mod, name, new)
    return f"cuflash.{modname}.{name} = {new!r} (was {old!r})"


#: What --cuflash-flag set, for the report header.
FLAGS_SET = []


def pytest_configure(config):
    for text in config.getoption("cuflash_flag"):
        FLAGS_SET.append(_apply_flag(text))
    if config.getoption("shard"):
        _parse_shard(config.getoption("shard"))


@pytest.hookimpl(trylast=True)   # after -m and -k have deselected theirs
def pytest_collection_modifyitems(config, items):
    if config.getoption("shard"):
        k, n = _parse_shard(config.getoption("shard"))
        keep = [it for i, it in enumerate(items) if i % n == k - 1]
        drop = [it for i, it in enumerate(items) if i % n != k - 1]
        if drop:
            config.hook.pytest_deselected(items=drop)
        items[:] = keep
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
