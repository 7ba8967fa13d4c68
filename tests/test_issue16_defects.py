"""Regression tests for the defects listed in issue 16 (defect 2, NaN/inf at masked positions,
is tested in tests/test_nonfinite.py). Each test failed before its fix."""
import json

import numpy as np
import pytest
from click.testing import CliRunner

import cuflash
from cuflash import _audit
from cuflash.cli import main


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def _qkv(shape=(2, 5, 8), dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal(shape).astype(dtype) for _ in range(3))


# 1. an unwritable --json path ----------------------------------------------------------------

def test_1_unwritable_json_fails_up_front_with_exit_2(tmp_path, monkeypatch):
    ran = []
    monkeypatch.setattr(_audit, "run_grid", lambda *a, **k: ran.append(1) or [])
    r = run("--device", "cpu", "--quick", "--json", tmp_path / "no_such_dir" / "x.json")
    assert r.exit_code == 2, r.output
    assert not ran, "the audit ran before the path was checked"
    assert "no_such_dir" in r.output and "does not exist" in r.output
    assert "Traceback" not in r.output and len(r.output.strip().splitlines()) == 1


def test_1_writable_json_path_is_not_left_behind_on_usage_errors(tmp_path):
    path = tmp_path / "x.json"
    r = run("--device", "gpu", "--quick", "--json", path) if not cuflash.gpu_available() else None
    if r is not None:
        assert r.exit_code == 2
        assert not path.exists()


# 3. a scale that is finite in float64 but not usable in the compute dtype --------------------

@pytest.mark.parametrize("scale", [1e40, -1e40, 1e-45, 10 ** 400, float("inf")])
def test_3_unusable_scale_raises_value_error_naming_it(scale):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="scale"):
        cuflash.attention(q, k, v, scale=scale)


def test_3_float64_takes_scales_float32_cannot():
    q, k, v = _qkv(dtype=np.float64)
    o = cuflash.attention(q * 1e-40, k, v, scale=1e40)
    assert np.all(np.isfinite(o))
    with pytest.raises(ValueError, match="scale"):
        cuflash.attention(q, k, v, scale=1.5e308)  # scale * log2(e) overflows float64
    assert np.all(np.isfinite(cuflash.attention(q, k, v, scale=0.0)))


# 4. a text file named .npz ----------------------------------------------------------------

def test_4_text_file_is_not_a_numpy_archive(tmp_path):
    path = tmp_path / "x.npz"
    path.write_text("hello, this is not an archive\n")
    r = run(path, "--device", "cpu")
    assert r.exit_code == 2, r.output
    assert "not a NumPy archive" in r.output
    assert "pickle" not in r.output.lower() and "unsafe" not in r.output.lower()


# 5. an .npz whose q holds NaN -------------------------------------------------------------

def test_5_nan_inputs_are_named_and_compared_by_position(tmp_path):
    q, k, v = _qkv((2, 5, 16))
    q[0, 2, 3] = np.nan
    path = tmp_path / "nan.npz"
    np.savez(path, q=q, k=k, v=v)
    r = run(path, "--device", "cpu")
    assert r.exit_code == 0, r.output
    assert "q holds 1 NaN" in r.output and "by position" in r.output
    assert "threshold nan" not in r.output and "nan >" not in r.output


def test_5_nan_in_the_wrong_place_fails(tmp_path, monkeypatch):
    q, k, v = _qkv((2, 5, 16))
    q[0, 2, 3] = np.nan
    path = tmp_path / "nan.npz"
    np.savez(path, q=q, k=k, v=v)
    real = _audit.attention

    def hides_nan(*a, **kw):
        o, lse = real(*a, **kw)
        o[np.isnan(o)] = 0
        return o, lse

    monkeypatch.setattr(_audit, "attention", hides_nan)
    r = run(path, "--device", "cpu")
    assert r.exit_code == 1, r.output
    assert "finite (or not NaN) where the reference is NaN" in r.output


# 6. no GPU driver ---------------------------------------------------------------------------

def test_6_no_driver_is_said_plainly_with_the_detail_on_a_second_line(monkeypatch):
    monkeypatch.setattr(_audit, "gpu_available", lambda: False)
    monkeypatch.setattr(_audit, "_no_gpu", lambda: (
        "no CUDA driver was found (libcuda cannot be loaded)",
        "CUDARuntimeError: cudaErrorInsufficientDriver: CUDA driver version is insufficient"))
    r = run("--quick", "--dtype", "float64", "--seed", 1)
    lines = r.output.splitlines()
    assert lines[0].startswith("device: cpu") and "no CUDA driver was found" in lines[0]
    assert "cudaErrorInsufficientDriver" not in lines[0]
    assert "detail:" in lines[1] and "cudaErrorInsufficientDriver" in lines[1]


def test_6_reason_when_cupy_reports_an_insufficient_driver_without_libcuda(monkeypatch):
    cupy = pytest.importorskip("cupy")

    def no_driver():
        raise cupy.cuda.runtime.CUDARuntimeError(35)  # cudaErrorInsufficientDriver

    monkeypatch.setattr(cupy.cuda.runtime, "getDeviceCount", no_driver)
    monkeypatch.setattr(_audit, "_driver_loadable", lambda: False)
    summary, detail = _audit._no_gpu()
    assert summary.startswith("no CUDA driver was found")
    assert "InsufficientDriver" in detail


# 7. out=[o, lse] -----------------------------------------------------------------------------

def test_7_out_pair_may_be_a_list():
    q, k, v = _qkv()
    o, lse = np.empty((2, 5, 8), np.float32), np.empty((2, 5), np.float32)
    ro, rl = cuflash.attention(q, k, v, return_lse=True, out=[o, lse])
    assert ro is o and rl is lse
    want, want_lse = cuflash.attention(q, k, v, return_lse=True)
    np.testing.assert_array_equal(o, want)
    np.testing.assert_array_equal(lse, want_lse)
    with pytest.raises(ValueError, match="only with return_lse=True"):
        cuflash.attention(q, k, v, out=[o, lse])


# 8. NumPy subclasses ------------------------------------------------------------------------

@pytest.mark.filterwarnings("ignore::PendingDeprecationWarning")  # np.matrix itself warns
@pytest.mark.parametrize("make", [lambda x: np.ma.masked_array(x, mask=x > 1),
                                  lambda x: np.asmatrix(x[0])],
                         ids=["masked_array", "matrix"])
@pytest.mark.parametrize("arg", ["q", "k", "v"])
def test_8_numpy_subclasses_are_refused_naming_the_argument(make, arg):
    q, k, v = _qkv()
    args = {"q": q, "k": k, "v": v}
    if "matrix" in type(make(q)).__name__:
        args = {n: x[0] for n, x in args.items()}  # 2-D, so only the subclass is wrong
    args[arg] = make(q)
    with pytest.raises(TypeError, match=rf"^{arg} is a numpy\.\S+, a subclass of numpy\.ndarray"):
        cuflash.attention(args["q"], args["k"], args["v"])


def test_8_subclass_out_and_merge_inputs_are_refused():
    q, k, v = _qkv()
    out = np.ma.masked_array(np.empty((2, 5, 8), np.float32))
    with pytest.raises(TypeError, match="^out is a numpy.ma"):
        cuflash.attention(q, k, v, out=out)
    o, lse = cuflash.attention(q, k, v, return_lse=True)
    with pytest.raises(TypeError, match="^o_a is a numpy.ma"):
        cuflash.merge_states(np.ma.masked_array(o), lse, o, lse)


# 9. bfloat16 in the CPU audit ----------------------------------------------------------------

def test_9_cpu_audit_includes_bfloat16_when_ml_dtypes_is_there(tmp_path):
    pytest.importorskip("ml_dtypes")
    assert "bfloat16" in _audit.Device().default_dtypes()
    path = tmp_path / "a.json"
    r = run("--device", "cpu", "--quick", "--seed", 2, "--json", path)
    assert r.exit_code == 0, r.output
    assert "bfloat16" in json.loads(path.read_text())["dtypes"]
