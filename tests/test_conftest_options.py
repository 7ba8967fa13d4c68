"""The suite's own options (tests/conftest.py), run in a child pytest on a small file:
``--shard K/N`` partitions the selected tests, ``--cuflash-flag`` sets a flag or refuses a typo
or a value of the wrong type. benchmarks/run_gpu_suite.sh relies on both on the GPU machine."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cuflash import _decode

ROOT = Path(__file__).resolve().parent.parent
TARGET = "tests/test_api.py"


def _pytest(*args):
    path = [str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def _ids(*args):
    r = _pytest(TARGET, "--collect-only", "-q", *args)
    assert r.returncode == 0, r.stdout + r.stderr
    return [line for line in r.stdout.splitlines() if "::" in line]


def test_shards_partition_the_selection_in_interleaved_order():
    every = _ids()
    assert len(every) >= 10
    shards = [_ids("--shard", f"{k}/3") for k in (1, 2, 3)]
    for k, ids in enumerate(shards):
        assert ids == every[k::3], f"shard {k + 1}/3 is not every third test from test {k}"
    assert sorted(sum(shards, [])) == sorted(every)


def test_shards_apply_after_k():
    sel = _ids("-k", "not dispatch")
    assert sel and len(sel) < len(_ids())
    assert _ids("-k", "not dispatch", "--shard", "2/2") == sel[1::2]


@pytest.mark.parametrize("arg, msg", [
    (["--shard", "0/2"], "1 <= K <= N"),
    (["--shard", "3/2"], "1 <= K <= N"),
    (["--shard", "1-2"], "K/N with integers"),
    (["--cuflash-flag", "_decode.NO_SUCH_FLAG=1"], "has no flag NO_SUCH_FLAG"),
    (["--cuflash-flag", "_nosuchmodule.FLAG=1"], "no module cuflash._nosuchmodule"),
    (["--cuflash-flag", "_decode.DECODE_VERSION=True"], "holds a int"),
    (["--cuflash-flag", "_decode.DECODE_VERSION=two"], "is not a Python literal"),
    (["--cuflash-flag", "DECODE_VERSION"], "MODULE.NAME=VALUE"),
])
def test_bad_options_are_usage_errors(arg, msg):
    r = _pytest(TARGET, "--collect-only", "-q", *arg)
    assert r.returncode == 4, (r.returncode, r.stdout, r.stderr)   # pytest's usage error
    assert msg in r.stdout + r.stderr


def test_flag_is_set_for_the_session_and_reported(tmp_path):
    probe = tmp_path / "test_probe.py"
    probe.write_text("from cuflash import _decode, _varlen\n"
                     "def test_probe():\n"
                     "    assert _decode.DECODE_VERSION == 3\n"
                     "    assert _varlen.VARLEN_HOPPER_GROUP == 2\n")
    # The probe sits outside tests/, so the suite's conftest comes in as a plugin.
    args = ["-p", "conftest", "--rootdir", str(ROOT), str(probe)]
    r = _pytest(*args)
    assert r.returncode == 1, "without the flags the probe must fail"
    r = _pytest(*args, "--cuflash-flag", "_decode.DECODE_VERSION=3",
                "--cuflash-flag", "_varlen.VARLEN_HOPPER_GROUP=2")
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"cuflash._decode.DECODE_VERSION = 3 (was {_decode.DECODE_VERSION})" in r.stdout
