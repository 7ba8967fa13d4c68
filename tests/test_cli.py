"""Tests of the ``cuflash-check`` command (CPU path; a few seconds in all)."""
import json
import re

import numpy as np
import pytest
from click.testing import CliRunner

import cuflash
from cuflash import _audit
from cuflash.cli import main
from seeds import SEED, case_rng

SUMMARY = re.compile(r"^(\d+) passed, (\d+) failed$", re.MULTILINE)


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def summary(output):
    m = SUMMARY.search(output)
    assert m, output
    return int(m.group(1)), int(m.group(2))


def test_quick_cpu_audit_passes():
    r = run("--quick", "--device", "cpu", "--seed", 3)
    assert r.exit_code == 0, r.output
    passed, failed = summary(r.output)
    assert failed == 0 and passed > 0
    assert "seed: 3" in r.output
    assert "chunk-order invariance" in r.output  # the property table is there too


def test_json_report(tmp_path):
    path = tmp_path / "audit.json"
    r = run("--quick", "--device", "cpu", "--seed", 5, "--dtype", "float32", "--dtype", "float64",
            "--json", path)
    assert r.exit_code == 0, r.output
    data = json.loads(path.read_text())
    assert len(data["cases"]) == len(_audit.standard_grid(quick=True)) * 2
    assert {c["dtype"] for c in data["cases"]} == {"float32", "float64"}
    assert all(c["result"] == "PASS" for c in data["cases"])
    assert data["seed"] == 5
    assert data["device"]["selected"] == "cpu"
    assert "numpy" in data["versions"]
    s = data["summary"]
    assert s["passed"] + s["failed"] == (len(data["cases"]) + len(data["properties"])
                                         + len(data["gradients"]["cases"]))
    assert summary(r.output) == (s["passed"], s["failed"])


def test_npz_file_is_audited(tmp_path):
    rng = np.random.default_rng(0)
    path = tmp_path / "qkv.npz"
    np.savez(path, q=rng.standard_normal((2, 5, 16)).astype(np.float32),
             k=rng.standard_normal((2, 9, 16)).astype(np.float32),
             v=rng.standard_normal((2, 9, 8)).astype(np.float32), causal=np.bool_(True))
    r = run(path, "--device", "cpu")
    assert r.exit_code == 0, r.output
    assert "(2,5,9,16,8)" in r.output and "float32" in r.output
    assert summary(r.output) == (1, 0)
    # --dtype casts the file's values.
    r = run(path, "--device", "cpu", "--dtype", "float16", "--dtype", "float64")
    assert r.exit_code == 0, r.output
    assert summary(r.output) == (2, 0)


def test_npz_missing_array(tmp_path):
    path = tmp_path / "no_v.npz"
    np.savez(path, q=np.ones((4, 8)), k=np.ones((4, 8)))
    r = run(path, "--device", "cpu")
    assert r.exit_code == 2
    assert "no_v.npz" in r.output and "missing" in r.output and "'v'" in r.output


def test_npz_bad_shapes_report_cuflash_message(tmp_path):
    path = tmp_path / "bad.npz"
    np.savez(path, q=np.ones((4, 8)), k=np.ones((4, 6)), v=np.ones((4, 8)))
    r = run(path, "--device", "cpu")
    assert r.exit_code == 2
    assert "bad.npz: " in r.output and "head dim" in r.output


@pytest.mark.skipif(cuflash.gpu_available(), reason="a GPU is present")
def test_device_gpu_without_gpu():
    r = run("--quick", "--device", "gpu")
    assert r.exit_code == 2
    assert "--device gpu" in r.output and "no usable CUDA GPU" in r.output


def test_broken_attention_is_caught(monkeypatch):
    real = _audit.attention

    def broken(q, k, v, **kw):
        o, lse = real(q, k, v, **kw)
        o[...] = o + 0.1  # o is the out= buffer: the corruption is what the caller receives
        return o, lse

    monkeypatch.setattr(_audit, "attention", broken)
    r = run("--quick", "--device", "cpu", "--dtype", "float32", "--seed", 1)
    assert r.exit_code == 1, r.output
    passed, failed = summary(r.output)
    assert failed >= len(_audit.standard_grid(quick=True))
    assert "FAIL" in r.output and "max abs error" in r.output


def test_help_states_the_pass_rule():
    r = run("--help")
    assert r.exit_code == 0
    text = " ".join(r.output.split())
    assert "2 * max|o_naive - o_ref| + 4 * u * A" in text


def test_unwritten_output_is_caught(monkeypatch):
    real = _audit.attention

    def lazy(q, k, v, *, out=None, **kw):
        o, lse = real(q, k, v, **kw)  # computed elsewhere; the last query row never reaches out
        if out is None:
            return o, lse
        out[0][..., :-1, :] = o[..., :-1, :]
        out[1][...] = lse
        return out

    monkeypatch.setattr(_audit, "attention", lazy)
    r = run("--quick", "--device", "cpu", "--dtype", "float64", "--seed", 2)
    assert r.exit_code == 1, r.output
    assert "NaN/inf" in r.output


def test_json_holds_no_bare_nan_from_peers(tmp_path, monkeypatch):
    """A peer whose error is NaN (or a nested field that is) must not break --json: the audit
    on the H200, where torch is importable, died in json.dump on a NaN inside the peers' dict."""
    import json
    import math

    from cuflash import _audit

    doc = {"cases": [{"peers": {"torch": math.nan, "jax": [math.inf, 1.0]}, "x": np.float32(2)}]}
    text = json.dumps(_audit._json_num(doc), allow_nan=False)
    assert json.loads(text)["cases"][0]["peers"] == {"torch": "NaN", "jax": ["Infinity", 1.0]}


# ---------------------------------------------------------------------------------------------
# --seed (review r5)

def test_negative_seed_is_a_usage_error_before_anything_runs(monkeypatch):
    """numpy.random.default_rng takes no negative seed: --seed -1 died in a traceback (exit 1,
    the failure status) after the device line; it is a usage error, checked up front."""
    ran = []
    monkeypatch.setattr(_audit, "run_grid", lambda *a, **k: ran.append(1) or [])
    r = run("--quick", "--device", "cpu", "--seed", -1)
    assert r.exit_code == 2, r.output
    assert not ran and "device:" not in r.output
    assert "--seed" in r.output and "non-negative" in r.output


def test_random_seed_is_printed_and_reproduces_the_run(tmp_path):
    def audit(seed, path):
        r = run("--quick", "--device", "cpu", "--dtype", "float64", "--no-peers", "--seed", seed,
                "--json", path)
        assert r.exit_code == 0, r.output
        return r, json.loads(path.read_text())

    r, first = audit("random", tmp_path / "a.json")
    seed = int(re.search(r"^seed: (\d+)", r.output, re.MULTILINE).group(1))
    assert first["seed"] == seed
    _, again = audit(seed, tmp_path / "b.json")
    for key in ("cases", "properties"):
        strip = [{n: x for n, x in c.items() if n != "seconds"} for c in first[key]]
        assert strip == [{n: x for n, x in c.items() if n != "seconds"} for c in again[key]]
    assert [{n: x for n, x in c.items() if n != "seconds"} for c in first["gradients"]["cases"]] \
        == [{n: x for n, x in c.items() if n != "seconds"} for c in again["gradients"]["cases"]]


# ---------------------------------------------------------------------------------------------
# FILE mode (review r5)

def _npz(path, seed=0, shape_q=(2, 5, 8), sk=9, dv=4, dtype=np.float32, **extra):
    """A tiny FILE problem from the seeded helpers, plus ``extra`` arrays; returns the arrays."""
    rng = case_rng(SEED, "npz", seed)
    b, sq, d = shape_q[:-2], shape_q[-2], shape_q[-1]
    arrays = dict(q=rng.standard_normal(shape_q).astype(dtype),
                  k=rng.standard_normal(b + (sk, d)).astype(dtype),
                  v=rng.standard_normal(b + (sk, dv)).astype(dtype))
    arrays.update(extra)
    np.savez(path, **arrays)
    return arrays


def test_npz_with_an_unknown_array_is_refused(tmp_path):
    """A misspelt "causal" (or "do") was dropped silently: the file's problem was audited
    non-causal (or without its gradients) and PASSED."""
    path = tmp_path / "extra.npz"
    _npz(path, is_causal=np.bool_(True), dO=np.ones((2, 5, 4), np.float32))
    r = run(path, "--device", "cpu", "--no-peers")
    assert r.exit_code == 2, r.output
    assert "unexpected arrays 'is_causal', 'dO'" in r.output
    assert "causal, scale, do" in r.output and "PASS" not in r.output


# ---------------------------------------------------------------------------------------------
# The variant audit (review r5): the forward's whole rule and every gradient

def _variant_audit(dtype="float32"):
    from cuflash._audit_variants import variant_audits

    return variant_audits(_audit.Device(), [dtype], case_rng(SEED, "variants", dtype),
                          _audit.PropertyResult, _audit.numpy_dtype)


def test_variant_audit_fails_a_nan_in_a_later_gradient(monkeypatch):
    """max() over [frac_dq, nan, frac_dv] is frac_dq or frac_dv: a NaN in dk passed."""
    import cuflash._cpu_backward as cpu_backward

    real = cpu_backward.attention_backward_numpy

    def nan_in_dk(*a, **kw):
        grads = real(*a, **kw)
        grads[1].reshape(-1)[3] = np.nan
        return grads

    monkeypatch.setattr(cpu_backward, "attention_backward_numpy", nan_in_dk)
    res = _variant_audit()
    assert res and not any(p.passed for p in res)
    assert all(p.measured == np.inf and "dk" in p.detail for p in res)


def test_variant_audit_checks_lse(monkeypatch):
    """The variant audit judged o and the gradients, never the lse (rule (3) of the forward):
    an lse off by 0.5 passed (the CPU backward recomputes its row statistics)."""
    import cuflash._cpu as cpu

    real = cpu.attention_numpy

    def off_lse(*a, **kw):
        o, lse = real(*a, **kw)
        if lse is not None:
            lse[np.isfinite(lse)] += 0.5
        return o, lse

    monkeypatch.setattr(cpu, "attention_numpy", off_lse)
    res = _variant_audit()
    assert res and not any(p.passed for p in res)
    assert all("lse error" in p.detail and p.measured > 1 for p in res)


def test_variant_audit_passes_cuflash_and_reports_its_worst_bar():
    res = _variant_audit("float16")
    assert res and all(p.passed for p in res), [p for p in res if not p.passed]
    assert all(0 < p.measured <= 1 and p.limit == 1.0 and "lse at" in p.detail for p in res)


def test_variant_audit_covers_a_block_mask_of_every_block_kind():
    """The audit's block-mask case spans several 64 x 64 blocks with kept, hidden and mixed ones
    in every batch entry (so a GPU audit runs tiles the kernels compute without the mask), is
    audited causal and not, and the device gets a BlockMask of its own (a summary made there)."""
    from cuflash import BlockMask, _mask_blocks
    from cuflash._audit_variants import BLOCK_MASK_SHAPE, _on_device, block_mask_cases

    batch = (2, 3)
    (name, kw), = block_mask_cases(case_rng(SEED, "block-mask"), batch, *BLOCK_MASK_SHAPE)
    bm = kw["mask"]
    assert isinstance(bm, BlockMask) and bm.mask.shape == batch + BLOCK_MASK_SHAPE
    blocks = bm.blocks.reshape(-1, *bm.blocks.shape[-2:])
    assert all({_mask_blocks.KEPT, _mask_blocks.HIDDEN, _mask_blocks.MIXED} <= set(b.ravel())
               for b in blocks), blocks
    np.testing.assert_array_equal(bm.blocks, _mask_blocks.numpy_summary(bm.mask))
    moved = _on_device(_audit.Device(), bm)
    assert isinstance(moved, BlockMask) and moved is not bm
    res = [p for p in _variant_audit() if p.name == f"variant {name}"]
    assert sorted(p.where for p in res) == ["cpu, float32", "cpu, float32, causal"]
    assert all(p.passed and 0 < p.measured <= 1 for p in res), res


def test_grad_verdict_never_passes_nan_or_an_error_over_a_zero_threshold():
    from cuflash._audit_variants import grad_verdict

    r = np.ones((2, 3))
    ok = r + 1e-9
    nan = r.copy()
    nan[1, 2] = np.nan
    assert grad_verdict(("dq", "dk"), (ok, ok), (r, r), (1e-8, 1e-8))[0] <= 1
    assert grad_verdict(("dq", "dk"), (ok, nan), (r, r), (1e-8, 1e-8))[0] == np.inf
    frac, why = grad_verdict(("dq",), (ok,), (r,), (0.0,))   # was 0.0: a pass
    assert frac == np.inf and "threshold 0" in why[0]
    assert grad_verdict(("dq",), (r,), (r,), (0.0,))[0] == 0.0
    assert grad_verdict(("dq",), (r[:1],), (r,), (1.0,))[0] == np.inf


# ---------------------------------------------------------------------------------------------
# Injected defects in the CPU path (review r5): each must FAIL in the table, in the JSON and in
# the exit status, in every dtype. A tiny causal FILE problem with Sq != Sk and a do.

DTYPES = ("float16", "float32", "float64")
#: A "small" error in one element: 60u for float16, some 150u for float32, 1e6 u for float64
#: (whose bars are a-priori bounds of ~1e-13 here); each well above the bars of these sizes.
SMALL = {"float16": 3e-2, "float32": 1e-5, "float64": 1e-10}


def _cpu_forward_defect(kind):
    import cuflash._cpu as cpu

    real = cpu.attention_numpy

    def broken(q, k, v, **kw):
        if kind == "no scale":
            return real(q, k, v, **{**kw, "scale": 1.0})
        if kind == "causal top-left":   # row i sees keys j <= i, not j <= i + Sk - Sq
            sq = q.shape[-2]
            return real(q, k[..., :sq, :], v[..., :sq, :], **kw)
        o, lse = real(q, k, v, **kw)
        if kind == "small error":
            o.reshape(-1)[o.size // 2] += SMALL[o.dtype.name]
        elif kind == "last row zero":
            o[..., -1, :] = 0
        elif kind == "one NaN":
            o.reshape(-1)[o.size // 3] = np.nan
        elif kind == "lse off":
            lse += 0.05
        elif kind == "lse in log2":
            lse *= np.float32(1 / np.log(2))
        return o, lse

    return cpu, "attention_numpy", broken


def _cpu_backward_defect(kind):
    import cuflash._cpu_backward as cpu_backward

    real = cpu_backward.attention_backward_numpy

    def broken(do, q, k, v, o, lse, **kw):
        grads = real(do, q, k, v, o, lse, **kw)
        if kind == "dq without the scale":
            grads[0][...] = grads[0] / kw["scale"]
        elif kind == "dv last key zero":
            grads[2][..., -1, :] = 0
        return grads

    return cpu_backward, "attention_backward_numpy", broken


FORWARD_DEFECTS = ["small error", "no scale", "last row zero", "one NaN", "causal top-left",
                   "lse off", "lse in log2"]
BACKWARD_DEFECTS = ["dq without the scale", "dv last key zero"]


@pytest.mark.parametrize("kind", FORWARD_DEFECTS + BACKWARD_DEFECTS)
def test_injected_defect_fails_in_table_json_and_exit_status(kind, tmp_path, monkeypatch):
    path, report = tmp_path / "p.npz", tmp_path / "audit.json"
    a = _npz(path, seed=kind, shape_q=(2, 3, 7, 16), sk=11, dv=8, causal=np.bool_(True))
    np.savez(path, **a, do=case_rng(SEED, "do", kind).standard_normal((2, 3, 7, 8)))
    args = [path, "--device", "cpu", "--no-peers", "--json", report]
    for dt in DTYPES:
        args += ["--dtype", dt]
    clean = run(*args)
    assert clean.exit_code == 0, clean.output          # the problem itself passes
    backward = kind in BACKWARD_DEFECTS
    monkeypatch.setattr(*(_cpu_backward_defect if backward else _cpu_forward_defect)(kind))
    r = run(*args)
    assert r.exit_code == 1, r.output
    doc = json.loads(report.read_text())
    assert doc["exit_status"] == 1 and doc["mode"] == "file"
    section = doc["gradients"]["cases"] if backward else doc["cases"]
    assert sorted(c["dtype"] for c in section) == sorted(DTYPES)
    assert all(c["result"] == "FAIL" and c["reasons"] for c in section), section
    assert doc["summary"]["failed"] >= len(DTYPES)
    assert summary(r.output)[1] == doc["summary"]["failed"]
    rows = [l for l in r.output.splitlines() if l.split()[:1] and l.split()[0] in DTYPES
            and "(2,3,7,11,16,8)" in l]
    failed = [l for l in rows if l.rstrip().endswith("FAIL")]
    assert len(failed) >= len(DTYPES), r.output
    assert sum(l.startswith("FAIL ") for l in r.output.splitlines()) >= len(DTYPES)


# ---------------------------------------------------------------------------------------------
# What ran, in the JSON (review r5)

def test_json_says_what_ran_and_its_exit_status(tmp_path):
    path = tmp_path / "a.json"
    r = run("--quick", "--device", "cpu", "--dtype", "float64", "--no-peers", "--json", path)
    assert r.exit_code == 0, r.output
    doc = json.loads(path.read_text())
    assert doc["mode"] == "standard" and doc["quick"] is True and doc["peers"] == []
    assert doc["exit_status"] == 0 and doc["seed"] == 0 and doc["file"] is None
    for c in doc["cases"]:
        for key in ("max_abs_err", "threshold", "bound", "frac_threshold", "frac_bound",
                    "lse_err", "lse_tol", "naive_err", "seed", "kernel", "shape", "causal"):
            assert key in c, key
    for g in doc["gradients"]["cases"]:
        assert set(g["err"]) == set(g["threshold"]) == {"dq", "dk", "dv"}
    npz = tmp_path / "p.npz"
    _npz(npz)
    r = run(npz, "--device", "cpu", "--no-peers", "--json", path)
    doc = json.loads(path.read_text())
    assert doc["mode"] == "file" and doc["quick"] is False and doc["file"] == str(npz)
    assert doc["seed"] is None and doc["exit_status"] == r.exit_code == 0


def test_npz_gradients_of_nan_inputs_are_not_judged_against_a_reference_without_nan(tmp_path):
    """q with a NaN and a do: the float64 reference gradients drop the NaN (its weight counts as
    0), so cuflash's correct NaN gradients FAILED and the run exited 1. Now the gradients are
    said not to be audited, in the output and the JSON."""
    path, report = tmp_path / "nan.npz", tmp_path / "a.json"
    a = _npz(path)
    a["q"][0, 2, 3] = np.nan
    np.savez(path, **a, do=case_rng(SEED, "do nan").standard_normal((2, 5, 4)))
    r = run(path, "--device", "cpu", "--no-peers", "--json", report)
    assert r.exit_code == 0, r.output
    assert "gradients: not audited: q holds NaN/inf" in r.output
    doc = json.loads(report.read_text())
    assert "q holds NaN/inf" in doc["gradients"]["skipped"] and doc["gradients"]["cases"] == []
    assert summary(r.output) == (1, 0)


def test_finite_lse_where_the_reference_lse_is_plus_inf_fails(tmp_path, monkeypatch):
    """A +inf score (an inf in k) makes the reference lse +inf; rule (3) checked only finite,
    -inf and NaN reference rows, so a finite lse there passed."""
    import cuflash._cpu as cpu

    path = tmp_path / "inf.npz"
    a = _npz(path)
    a["q"][...] = np.abs(a["q"]) + 0.5
    a["k"][1, 4, :] = np.inf         # every row of batch 1 scores +inf on key 4
    np.savez(path, **a)
    r = run(path, "--device", "cpu", "--no-peers")
    assert r.exit_code == 0, r.output
    real = cpu.attention_numpy

    def finite_lse(*args, **kw):
        o, lse = real(*args, **kw)
        lse[~np.isfinite(lse)] = 0.0
        return o, lse

    monkeypatch.setattr(cpu, "attention_numpy", finite_lse)
    r = run(path, "--device", "cpu", "--no-peers")
    assert r.exit_code == 1, r.output
    assert "5 lse entries are finite where the reference is NaN or +inf" in r.output


@pytest.mark.skipif(not __import__("os").path.exists("/dev/full"), reason="needs /dev/full")
def test_json_that_cannot_be_written_at_the_end_is_exit_2_after_the_verdict(tmp_path,
                                                                             monkeypatch):
    """The path passes the check up front but the write fails (a full disk): a traceback and
    exit status 1, the failure status, before the verdict was printed."""
    from cuflash import _report

    npz = tmp_path / "p.npz"
    _npz(npz)
    r = run(npz, "--device", "cpu", "--no-peers", "--json", "/dev/full")
    assert r.exit_code == 2, r.output
    assert "1 passed, 0 failed" in r.output and "--json /dev/full: cannot write it" in r.output

    def full(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(_report, "write_report", full)
    r = run(npz, "--device", "cpu", "--no-peers", "--report", tmp_path / "rep")
    assert r.exit_code == 2 and "1 passed, 0 failed" in r.output
    assert "No space left on device" in r.output


@pytest.mark.parametrize("do", [np.ones((2, 5, 4), np.complex64), np.array("x")],
                         ids=["complex", "text"])
def test_npz_do_that_is_not_real_is_refused_naming_it(tmp_path, do):
    """A complex do lost its imaginary part in np.asarray(do, float64) and the gradients were
    audited (and PASSED) for another do than the file's."""
    path = tmp_path / "do.npz"
    _npz(path, do=do)
    r = run(path, "--device", "cpu", "--no-peers")
    assert r.exit_code == 2, r.output
    assert "'do' must be a real array" in r.output and "PASS" not in r.output


def test_json_onto_the_file_audited_is_refused(tmp_path):
    """cuflash-check x.npz --json x.npz overwrote the user's inputs with the results."""
    path = tmp_path / "p.npz"
    _npz(path)
    before = path.read_bytes()
    r = run(path, "--device", "cpu", "--no-peers", "--json", path)
    assert r.exit_code == 2, r.output
    assert "overwrite the inputs" in r.output and path.read_bytes() == before
