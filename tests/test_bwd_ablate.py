"""benchmarks/bwd_ablate.py: its ablations still find the code they remove in attn_bwd_wgmma.cu
(the kernel drifting away from the tool's patch strings would make `make` fail, or an ablation
silently remove nothing), and a variant spec parses as documented. CPU only; the timing needs a
GPU of compute capability 9.0."""
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import bwd_ablate  # noqa: E402


def test_make_removes_each_part(tmp_path):
    bwd_ablate.make(tmp_path, ROOT / "kernels_cu")
    src = (ROOT / "kernels_cu" / "attn_bwd_wgmma.cu").read_text()
    base = (tmp_path / "base" / "attn_bwd_wgmma.cu").read_text()
    assert base == src
    nored = (tmp_path / "noreduce" / "attn_bwd_wgmma.cu").read_text()
    for call, arg in bwd_ablate._REDUCTIONS:  # both reduction forms, each predicated off once
        assert nored.count(f"if ({arg} == 1.2345e-30f) {call}") == 1
    noload = (tmp_path / "noload" / "attn_bwd_wgmma.cu").read_text()
    assert bwd_ablate._NEXT_LOAD not in noload
    assert noload.count("l2_next, dl_next, false);") == 1 and noload.count("if (copy) {") == 1
    # the other kernel families are the tree's
    for f in (ROOT / "kernels_cu").iterdir():
        if f.name != "attn_bwd_wgmma.cu" and f.is_file():
            assert (tmp_path / "noreduce" / f.name).read_bytes() == f.read_bytes()


def test_variant_specs(tmp_path):
    bwd_ablate.make(tmp_path, ROOT / "kernels_cu")
    v = bwd_ablate.parse_variants([f"a={tmp_path}/base", f"b={tmp_path}/noreduce@16",
                                   f"c={tmp_path}/base@@det"])
    assert v["a"] == ((tmp_path / "base").resolve(), None, False)
    assert v["b"] == ((tmp_path / "noreduce").resolve(), 16, False)
    assert v["c"] == ((tmp_path / "base").resolve(), None, True)
    with pytest.raises(SystemExit):
        bwd_ablate.parse_variants([f"x={tmp_path}"])  # no attn_bwd_wgmma.cu there


def test_bulk_candidate_compiles_without_spills(tmp_path):
    """The bulk-reduction candidate's tree (``make``'s ``bulk``) stages and adds dq with
    cp.reduce.async.bulk in the non-deterministic D = 64 / 128 kernels only (the deterministic and
    D = 256 kernels are the base's), and compiles for sm_90a without spills or stack."""
    from cuflash import _compile, _dispatch

    bwd_ablate.make(tmp_path, ROOT / "kernels_cu")
    text = (tmp_path / "bulk" / "attn_bwd_wgmma.cu").read_text()
    assert text.count("bulk_red_add(dqa") == 1 and text.count("wait_group.read 0") == 1
    spec = _dispatch.bwd_hopper_plan("float16", 128, False, False).passes[0][1].spec
    old_dir = _compile.SOURCE_DIR
    try:
        _compile.SOURCE_DIR = tmp_path / "bulk"
        _compile.family_source.cache_clear()
        rep = _compile.compile_report(spec, "sm_90a")
    finally:
        _compile.SOURCE_DIR = old_dir
        _compile.family_source.cache_clear()
    assert (rep.spill_stores, rep.spill_loads, rep.stack_bytes) == (0, 0, 0), rep.summary()
    from test_compile import _sass  # noqa: E402

    sass = _sass(rep.cubin)
    assert "UBLKRED.G.S.ADD.F32" in sass, "no bulk reduction in the SASS"
    assert "REDG" not in sass  # every dq addition of this kernel is a bulk one
