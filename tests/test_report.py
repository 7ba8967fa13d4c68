"""`cuflash-check --report DIR`, the progress display, the streamed table and the peer columns
(issue 16). CPU path; the report tests need matplotlib (the `report` extra)."""
import html.parser
import json
import os

import numpy as np
import pytest
from click.testing import CliRunner

from cuflash import _audit, reference
from cuflash.cli import main


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


class _Refs(html.parser.HTMLParser):
    """Every src/href in a page, and whether it pulls anything else in (scripts, links)."""

    def __init__(self):
        super().__init__()
        self.refs, self.tags = [], []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        for name, value in attrs:
            if name in ("src", "href") and value is not None:
                self.refs.append(value)


def test_report_is_written_self_contained_and_its_images_decode(tmp_path):
    pytest.importorskip("matplotlib")
    from matplotlib import image

    out = tmp_path / "rep"
    r = run("--quick", "--device", "cpu", "--dtype", "float16", "--dtype", "float64",
            "--seed", 4, "--report", out, "--no-peers")
    assert r.exit_code == 0, r.output
    index = out / "index.html"
    assert index.is_file() and f"report: {index}" in r.output
    parser = _Refs()
    parser.feed(index.read_text(encoding="utf-8"))
    assert "script" not in parser.tags and "link" not in parser.tags
    pngs = [ref for ref in parser.refs if ref.endswith(".png")]
    assert len(pngs) >= 8
    for ref in parser.refs:
        assert "://" not in ref and not ref.startswith("/"), ref   # nothing from elsewhere
        path = out / ref
        assert path.is_file(), f"the page references {ref}, which was not written"
    for ref in pngs:
        img = image.imread(out / ref)
        assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100
        assert np.std(img) > 0.01, f"{ref} is blank"
    text = index.read_text(encoding="utf-8")
    for needle in ("numpy", "seed 4", "err/bound", "chunk-order", "merge", "overflow",
                   "underflow", "passed"):
        assert needle in text, needle


def test_report_dir_is_checked_before_the_audit(tmp_path, monkeypatch):
    ran = []
    monkeypatch.setattr(_audit, "run_grid", lambda *a, **k: ran.append(1) or [])
    blocker = tmp_path / "file"
    blocker.write_text("x")
    r = run("--quick", "--device", "cpu", "--report", blocker)
    assert r.exit_code == 2 and not ran
    assert "is a file" in r.output
    r = run("--quick", "--device", "cpu", "--report", blocker / "sub")
    assert r.exit_code == 2 and not ran
    assert "cannot create it" in r.output and "Traceback" not in r.output


def test_report_without_matplotlib_says_how_to_get_it(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_mpl(name, *a, **k):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError("no matplotlib")
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_mpl)
    r = run("--quick", "--device", "cpu", "--report", tmp_path / "rep")
    assert r.exit_code == 2
    assert "cuflash[report]" in r.output


def test_report_from_a_saved_json(tmp_path):
    pytest.importorskip("matplotlib")
    from cuflash import _report

    path = tmp_path / "a.json"
    r = run("--quick", "--device", "cpu", "--dtype", "float32", "--json", path, "--no-peers")
    assert r.exit_code == 0
    index = _report.write_report(str(tmp_path / "rep"), json.loads(path.read_text()))
    assert os.path.isfile(index)


def test_progress_lines_in_logs_and_rows_as_results_arrive(monkeypatch):
    """Not a terminal (CliRunner): a progress line every --progress-every seconds, and each row
    printed as its case is judged, before the property audits run."""
    order = []
    real_props = _audit.property_audits

    def props(*a, **k):
        order.append("properties")
        return real_props(*a, **k)

    monkeypatch.setattr(_audit, "property_audits", props)
    r = run("--quick", "--device", "cpu", "--dtype", "float32", "--progress-every", 0,
            "--no-peers")
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    progress = [i for i, l in enumerate(lines) if l.startswith("auditing: ")]
    end = next(i for i, l in enumerate(lines) if l.startswith("property audits"))
    rows = [i for i, l in enumerate(lines[:end]) if l.startswith("float32 ")]  # not gradients
    n = len(_audit.standard_grid(quick=True))
    assert len(rows) == n
    assert len(progress) >= n      # one per shape with --progress-every 0, and the last
    assert "(done)" in lines[progress[-1]]
    # rows and progress lines interleave: the table is printed as results arrive
    assert progress[0] < rows[-1]
    assert "\r" not in r.output    # no terminal control characters in a log


def test_peer_columns_and_ratio(monkeypatch):
    """A stand-in peer (the naive implementation): its error and cuflash's ratio to it."""
    def fake(device, q, k, v, causal, scale, dtype):
        return reference.naive_attention(q, k, v, causal=causal, scale=scale, dtype=dtype)

    monkeypatch.setitem(_audit.PEERS, "fake", fake)
    monkeypatch.setattr(_audit, "available_peers", lambda: ["fake"])
    r = run("--quick", "--device", "cpu", "--dtype", "float16", "--seed", 1)
    assert r.exit_code == 0, r.output
    assert "best peer" in r.output and "err/peer" in r.output and "peers: fake" in r.output
    inp = _audit.draw_inputs(_audit.standard_grid(quick=True)[0], 1, 0)
    res = _audit.run_inputs(_audit.Device(), inp, ["float16"], peers=["fake"])[0]
    assert res.peer_best == "fake"
    assert res.ratio_to_peer == pytest.approx(res.max_abs_err / res.peer_err["fake"])
    assert res.peer_err["fake"] == pytest.approx(res.naive_err)


def test_a_peer_that_cannot_run_is_not_a_failure(monkeypatch):
    def broken(*a, **k):
        raise RuntimeError("no kernel for this dtype")

    monkeypatch.setitem(_audit.PEERS, "broken", broken)
    inp = _audit.draw_inputs(_audit.standard_grid(quick=True)[0], 1, 0)
    res = _audit.run_inputs(_audit.Device(), inp, ["float32"], peers=["broken"])[0]
    assert res.passed and np.isnan(res.peer_err["broken"]) and res.peer_best == ""


@pytest.mark.parametrize("peer", ["torch", "jax"])
def test_real_peers_when_importable(peer):
    pytest.importorskip(peer)
    inp = _audit.draw_inputs(_audit.Shape((2, 3), 113, 7, 64, 64, True), 0, 1)
    res = _audit.run_inputs(_audit.Device(), inp, ["float32"], peers=[peer])[0]
    err = res.peer_err[peer]
    # A correct SDPA in float32 is within a few float32 roundings of the reference.
    assert np.isfinite(err) and err < 1e-4, res.peer_err
    assert res.peer_best == peer and np.isfinite(res.ratio_to_peer)


def test_report_lists_failures_in_view_and_says_what_ran(tmp_path, monkeypatch):
    """The page gave only counts and folded tables with reasons on hover; it now lists each
    failure with its reasons, the mode (the FILE's path), the gradient cases and the peers."""
    pytest.importorskip("matplotlib")
    import cuflash._cpu as cpu

    real = cpu.attention_numpy

    def zero_last_row(*a, **kw):
        o, lse = real(*a, **kw)
        o[..., -1, :] = 0
        return o, lse

    rng = np.random.default_rng(3)
    path = tmp_path / "p.npz"
    np.savez(path, q=rng.standard_normal((2, 5, 8)).astype(np.float32),
             k=rng.standard_normal((2, 9, 8)).astype(np.float32),
             v=rng.standard_normal((2, 9, 4)).astype(np.float32),
             do=rng.standard_normal((2, 5, 4)).astype(np.float32))
    monkeypatch.setattr(cpu, "attention_numpy", zero_last_row)
    out = tmp_path / "rep"
    r = run(path, "--device", "cpu", "--no-peers", "--report", out)
    assert r.exit_code == 1, r.output
    text = (out / "index.html").read_text(encoding="utf-8")
    assert "<h2>Failures</h2>" in text and "max abs error" in text
    assert f"mode file {path}" in text and "1 gradient cases" in text and "peers none" in text
