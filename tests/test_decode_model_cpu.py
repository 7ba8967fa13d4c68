"""The decode kernel's work split (tests/decode_model.py: row blocks of 16 MT rows, key splits,
warps, the warp merge and the split combine, with the kernel's index arithmetic) against the
float64 reference under the project's rule, for grouped-query groups 1, 4, 8 and 32, Sq = 1 and
Sq > 1, tails 1/7/113/1000, empty caches, MT = 1 and 2, and split counts forced to the extremes
(one split; one key tile per split). CPU only; the GPU runs the same cases in
tests/test_inference_gpu.py."""
import math

import numpy as np
import pytest

from cuflash import _decode, reference

from decode_model import decode_model
from seeds import SEED, case_rng

MAX = 10**6   # a forced split count past every cap: one key tile per split


@pytest.mark.parametrize("version", [2, 1])
@pytest.mark.parametrize("splits", [None, 1, MAX])
@pytest.mark.parametrize("mt", [1, 2])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sk", [1, 7, 113, 1000])
@pytest.mark.parametrize("g,sq", [(1, 1), (4, 1), (8, 1), (32, 1), (8, 3), (4, 16)])
def test_decode_split_model(g, sq, sk, causal, mt, splits, version):
    rng = case_rng(SEED, "decode-model", g, sq, sk, causal, mt, splits, version)
    d = 64
    q = reference.round_to(rng.standard_normal((g, sq, d)), "float16")
    k, v = (reference.round_to(rng.standard_normal((sk, d)), "float16") for _ in range(2))
    scale = 1 / math.sqrt(d)
    o, lse, used = decode_model(q, k, v, causal=causal, scale=scale, mt=mt, splits=splits,
                                version=version)
    n_tiles = -(-sk // _decode.DECODE_BN)
    if splits == MAX:
        assert used == n_tiles
    elif splits == 1:
        assert used == 1
    assert not np.isnan(o).any() and not np.isnan(lse).any(), "a row was not written"
    rule = reference.pass_threshold(q, k[None], v[None], causal=causal, dtype="float16",
                                    scale=scale)
    verdict = rule.judge(o)
    assert verdict.passed, "; ".join(verdict.reasons)
    _, lse_ref = reference.attention_ref(q, k[None], v[None], causal=causal, scale=scale)
    fin = np.isfinite(lse_ref)
    assert np.array_equal(np.isneginf(lse), ~fin)
    assert np.all(np.abs(lse[fin] - lse_ref[fin]) <= 1e-4 + 1e-5 * np.abs(lse_ref[fin]))


@pytest.mark.parametrize("mt", [1, 2])
def test_decode_split_model_empty_cache(mt):
    """A sequence with no key: o = 0 and lse = -inf on every row (no tile, no split work)."""
    rng = case_rng(SEED, "decode-model-empty", mt)
    q = reference.round_to(rng.standard_normal((32, 2, 64)), "float16")
    k = v = np.zeros((0, 64))
    o, lse, used = decode_model(q, k, v, causal=False, scale=0.125, mt=mt)
    assert used == 1 and np.all(o == 0) and np.all(np.isneginf(lse))


def test_row_tiles_per_block():
    """MT = 2 exactly when an entry has more than 16 packed rows and D <= 128; the plan carries
    it in block_m, the kernel name and the label; configure pads the row tiles to it."""
    for d, rows, mt in ((128, 1, 1), (128, 16, 1), (128, 17, 2), (64, 32, 2), (128, 128, 2),
                        (256, 32, 1), (96, 24, 2)):
        plan = _decode.decode_plan("float16", d, False, False, rows=rows)
        assert plan.block_m == 16 * mt
        assert (f", 2, false, false, {_decode.DECODE_VERSION}>" in plan.spec.name) == (mt == 2)
        assert ("R32" in plan.label) == (mt == 2)
        attrs = dict(max_smem_optin=227 * 1024, sm_count=132)
        g = rows
        cfg = _decode.configure(plan, (1, 2, 3), g, 1, 5000, d, attrs)
        assert cfg.n_rtiles % mt == 0 and 16 * cfg.n_rtiles >= rows
        assert cfg.grid == 6 * (cfg.n_rtiles // mt) * cfg.splits
    for d, rows, n in ((128, 1, 3), (128, 32, 2), (256, 1, 1), (256, 32, 1), (64, 1, 4),
                       (64, 32, 3)):
        assert _decode.blocks_per_sm(_decode.decode_plan("float16", d, False, False, rows=rows),
                                     d) == n, (d, rows)


ISSUE_GRID = [(b, sk, hkv) for b in (1, 8, 64) for sk in (1024, 8192, 32768, 131072)
              for hkv in (32, 8, 1)]


@pytest.mark.parametrize("b,sk,hkv", ISSUE_GRID)
def test_issue_grid_fills_the_gpu(b, sk, hkv):
    """At every point of issue 14's decode grid (H = 32, D = 128, Sq = 1) on 132 SMs, K and V
    are read once per entry (one row block: G <= 32 rows), and the split keeps every block slot
    at least half busy in the first wave unless the keys run out (at most one split per 4 key
    tiles)."""
    g = 32 // hkv
    plan = _decode.decode_plan("float16", 128, False, False, rows=g)
    cfg = _decode.configure(plan, (1, b, hkv), g, 1, sk, 128,
                            dict(max_smem_optin=227 * 1024, sm_count=132))
    assert cfg.n_rtiles // (plan.block_m // 16) == 1          # one row block per entry
    slots = 132 * _decode.blocks_per_sm(plan, 128)
    n_tiles = sk // _decode.DECODE_BN
    cap = -(-n_tiles // _decode.DECODE_WARPS)
    assert cfg.grid >= min(slots, b * hkv * cap) * 0.5 or cfg.splits == cap


@pytest.mark.parametrize("dpad", _decode.DECODE_DPADS)
def test_combine_columns(dpad):
    """Version 2's combine grid (rows, CB): CB a power of two dividing the row's DPAD / 4 float4
    chunks, the least with which no thread of the 128 loads more than COMBINE_LOADS splits
    (attn_decode.cu's constant, read from the source), for every split count up to
    MAX_SPLITS; version 1 and one split: CB = 1."""
    import re

    from kernels_cu import SOURCE_DIR

    src = (SOURCE_DIR / "attn_decode.cu").read_text()
    assert int(re.search(r"constexpr int COMBINE_LOADS = (\d+);", src).group(1)) == \
        _decode.COMBINE_LOADS
    assert int(re.search(r"constexpr int MAX_SPLITS = (\d+);", src).group(1)) == \
        _decode.MAX_SPLITS
    ch = dpad // 4
    for s in range(1, _decode.MAX_SPLITS + 1):
        cb = _decode.combine_columns(s, dpad, 2)
        assert _decode.combine_columns(s, dpad, 1) == 1
        assert cb & (cb - 1) == 0 and ch % cb == 0
        ng = _decode.COMBINE_THREADS * cb // ch
        assert -(-s // ng) <= _decode.COMBINE_LOADS
        if cb > 1:
            assert -(-s // (ng // 2)) > _decode.COMBINE_LOADS   # the least such CB
    assert _decode.combine_columns(1, dpad, 2) == 1


def test_versions_plans_and_specialisations():
    """Each kernel version has its own instantiation (the name's last template argument) and
    label suffix; version 1 pairs with combine version 1, versions 2-7 with 2; the compile
    check's list has every version's kernels; an unknown version is refused."""
    for v, suffix in ((1, ",v1>"), (2, "full>"), (3, ",v3>"), (4, ",v4>"), (5, ",v5>"),
                      (6, ",v6>"), (7, ",v7>"), (8, ",v8>")):
        plan = _decode.decode_plan("bfloat16", 128, False, True, rows=32, version=v, rule=2)
        assert plan.spec.name.endswith(f", {v}>") and plan.label.endswith(suffix)
        assert _decode.version_of(plan) == v
        cfg = _decode.configure(plan, (1, 1, 1), 32, 1, 8192, 128,
                                dict(max_smem_optin=227 * 1024, sm_count=132))
        comb = _decode.combine_spec_for(plan, cfg).name
        assert comb.endswith(f", {1 if v == 1 else 2}>")   # 8: more splits than combine 3's
        assert cfg.splits > _decode.COMBINE3_SPLITS[128]
        assert cfg.comb_cb == (1 if v == 1 else _decode.combine_columns(cfg.splits, 128))
    names = {s.name for s in _decode.all_decode_specialisations()}
    for v in _decode.DECODE_VERSIONS:
        for rows in (1, 32):
            for paged in (False, True):
                assert _decode.decode_plan("float16", 64, True, paged, rows=rows,
                                           version=v).spec.name in names
    assert _decode.decode_plan("float16", 64, True, False, version=4).spec.arch == "sm_90"
    with pytest.raises(ValueError, match="sm_90 only"):
        _decode.configure(_decode.decode_plan("float16", 64, True, False, version=4), (1, 1, 1),
                          1, 1, 100, 64, dict(max_smem_optin=227 * 1024, sm_count=108,
                                              compute_capability=80))
    with pytest.raises(ValueError, match="versions"):
        _decode.decode_plan("float16", 64, True, False, version=9)


def test_combine_version_3_choice():
    """Combine version 3 (one warp a packed row) goes with kernel version 8 only, for 2 to
    COMBINE3_SPLITS[dpad] splits (attn_decode.cu's NS3, read from the source), exactly where
    version 2's grid has CB = 1, so that version 3's fixed order (version 2's split groups at
    CB = 1) is version 2's; kernel version 1 keeps combine 1 and the others combine 2; its
    specialisations are in the compile check's list."""
    import re

    from kernels_cu import SOURCE_DIR

    src = (SOURCE_DIR / "attn_decode.cu").read_text()
    big, small = re.search(r"constexpr int NS3 = DPAD > 128 \? (\d+) : (\d+);", src).groups()
    assert _decode.COMBINE3_SPLITS == {64: int(small), 128: int(small), 256: int(big)}
    assert int(re.search(r"blockIdx.x \* (\d+)u \+ threadIdx.x / 32", src).group(1)) == \
        _decode.COMBINE3_ROWS == _decode.COMBINE_THREADS // 32
    for dpad in _decode.DECODE_DPADS:
        for s in range(1, _decode.MAX_SPLITS + 1):
            c8 = _decode.combine_version(8, s, dpad)
            assert c8 == (3 if 2 <= s <= _decode.COMBINE3_SPLITS[dpad] else 2), (dpad, s)
            if c8 == 3:
                assert _decode.combine_columns(s, dpad, 2) == 1
                assert _decode.combine_columns(s, dpad, 3) == 1
            assert _decode.combine_version(1, s, dpad) == 1
            for v in (2, 3, 4, 5, 6, 7):
                assert _decode.combine_version(v, s, dpad) == 2
    names = {s.name for s in _decode.all_decode_specialisations()}
    for dt in _decode.DECODE_DTYPES:
        for dpad in _decode.DECODE_DPADS:
            assert _decode.combine_spec(dt, dpad, 3).name in names


@pytest.mark.parametrize("b,sk,hkv,splits", [
    (64, 1024, 1, 4), (8, 1024, 1, 16), (1, 1024, 1, 16), (8, 1024, 32, 3), (64, 1024, 8, 2)])
def test_version_8_launch_at_the_short_key_points(b, sk, hkv, splits):
    """Issue 14's short-key points (H200, rule 2): version 8's main launch is version 6's (same
    splits, grid, shared memory, workspace) and its combine is version 3 on a 1-D grid of
    ceil(rows / 4) blocks, a warp a packed row; version 6 keeps combine 2 on (rows, CB)."""
    g = 32 // hkv
    cfgs, plans = {}, {}
    for v in (6, 8):
        plans[v] = _decode.decode_plan("float16", 128, False, False, rows=g, version=v, rule=2)
        cfgs[v] = _decode.configure(plans[v], (1, b, hkv), g, 1, sk, 128, H200)
    c6, c8 = cfgs[6], cfgs[8]
    assert c6.splits == c8.splits == splits
    assert (c6.grid, c6.split_tiles, c6.part_bytes, c6.o_part_bytes) == \
        (c8.grid, c8.split_tiles, c8.part_bytes, c8.o_part_bytes)
    assert plans[6].smem_bytes == plans[8].smem_bytes
    assert c6.comb_ver == 2 and c6.comb_grid == (b * hkv * g, c6.comb_cb)
    assert c8.comb_ver == 3 and c8.comb_cb == 1
    assert c8.comb_grid == (-(-b * hkv * g // 4), 1)
    assert _decode.combine_spec_for(plans[8], c8).name.endswith(", 128, 3>")
    assert _decode.combine_spec_for(plans[6], c6).name.endswith(", 128, 2>")


def test_version_8_combine_grid_covers_odd_row_counts():
    """Combine 3's grid rounds the packed rows up to whole blocks of four (the kernel's warps
    past the last row leave): 3 rows (G = 1, Sq = 3) -> 1 block, 2 x 5 x 3 rows -> 8."""
    plan = _decode.decode_plan("bfloat16", 64, False, True, rows=3, version=8)
    cfg = _decode.configure(plan, (1, 1, 1), 1, 3, 300, 64, H200)
    assert cfg.splits > 1 and cfg.comb_ver == 3 and cfg.comb_grid == (1, 1)
    cfg = _decode.configure(plan, (1, 2, 5), 1, 3, 300, 64, H200)
    assert cfg.comb_ver == (3 if cfg.splits <= 16 else 2)
    if cfg.comb_ver == 3:
        assert cfg.comb_grid == (8, 1)


# ---------------------------------------------------------------------------------------------
# Split rule 3 (`_decode.DECODE_SPLIT_RULE = 3`, selectable; rule 2 the default)

H200 = dict(max_smem_optin=227 * 1024, sm_count=132, compute_capability=90)


def _splits(b, sk, hkv, rule, version=None):
    g = 32 // hkv
    plan = _decode.decode_plan("float16", 128, False, False, rows=g, version=version, rule=rule)
    return _decode.configure(plan, (1, b, hkv), g, 1, sk, 128, H200)


@pytest.mark.parametrize("b,sk,hkv,rule2,rule3", [
    (8, 1024, 32, 3, 1),      # one split measured 3370 against the rule's 2813-2846 GB/s
    (64, 1024, 8, 2, 1),      # one split measured +2-4%
    (64, 1024, 32, 2, 1),     # one split measured +2-4%
    (1, 1024, 32, 8, 8),      # B = 1: one split measured slower; both rules split
    (1, 1024, 8, 16, 16),
    (1, 1024, 1, 16, 16),
    (64, 1024, 1, 4, 4),      # Hkv = 1: one split measured slower
    (1, 131072, 8, 48, 35),   # the long-key points keep a near-full first wave
    (8, 131072, 1, 32, 32),
])
def test_rule3_choices_at_the_measured_points(b, sk, hkv, rule2, rule3):
    """The two rules' split counts at issue 14's points with H200 measurements of version 2
    (benchmarks/decode_model.py MEASURED_V2; notes/INFERENCE.md "Split rule 3"): rule 3 takes
    one split where one split measured faster than rule 2's choice and keeps the splits where
    one split measured slower; rule 2 is unchanged; the default, rule 4, is rule 2's count
    except one split wherever rule 3's is one."""
    assert _decode.DECODE_SPLIT_RULE == 4
    assert _splits(b, sk, hkv, 2).splits == rule2
    assert _splits(b, sk, hkv, 3).splits == rule3
    assert _splits(b, sk, hkv, 4).splits == (1 if rule3 == 1 else rule2)
    assert _splits(b, sk, hkv, None).splits == _splits(b, sk, hkv, 4).splits


def test_rule3_is_what_the_plan_and_its_size_queries_use(monkeypatch):
    """With DECODE_SPLIT_RULE = 3 every decode entry point's plan carries rule 3 (label
    ",rule3"), `configure` takes `choose_splits_v3`'s count, and the workspace sizes
    (dense `attention`, kvcache, varlen) are rule 3's; a plan made under one rule keeps its
    rule after the flag changes (its configuration and workspace size do not go stale)."""
    import types

    from cuflash import _kvcache, _varlen

    monkeypatch.setattr(_decode, "DECODE_SPLIT_RULE", 3)
    plan = _decode.decode_plan("float16", 128, False, False, rows=1)
    assert plan.label.endswith(",rule3>") and _decode.rule_of(plan) == 3
    cfg = _decode.configure(plan, (1, 8, 32), 1, 1, 1024, 128, H200)
    v3 = _decode.choose_splits_v3(256, 64, 132, _decode.blocks_per_sm(plan, 128), 8192, 512, 1)
    assert cfg.splits == v3 == 1 and cfg.part_bytes == 0
    kv = types.SimpleNamespace(dtype_name="float16", d=128, causal=False, b=8, h=32, hkv=32,
                               sq=1, snew=0, capacity=1024, page=0, block_table=None,
                               seqlens_int=None)
    kplan, kcfg, need = _kvcache.kvcache_launch(kv, H200)
    assert kplan.label.endswith(",rule3>") and kcfg.splits == 1 and need == 0
    vl = types.SimpleNamespace(dtype_name="float16", d=128, dv=128, causal=False, nseq=8, h=32,
                               hkv=32, max_q=1, max_k=1024, kernel="decode")
    vplan, vcfg, vneed = _varlen.varlen_launch(vl, H200)
    assert vplan.label.endswith(",rule3>") and vcfg.splits == 1 and vneed == 0
    monkeypatch.setattr(_decode, "DECODE_SPLIT_RULE", 2)
    assert _decode.configure(plan, (1, 8, 32), 1, 1, 1024, 128, H200) == cfg   # its own rule
    plan2 = _decode.decode_plan("float16", 128, False, False, rows=1)
    cfg2 = _decode.configure(plan2, (1, 8, 32), 1, 1, 1024, 128, H200)
    assert cfg2.splits == 3 and cfg2.part_bytes > 0
    kplan2, kcfg2, need2 = _kvcache.kvcache_launch(kv, H200)
    assert kcfg2.splits == 3 and need2 == kcfg2.part_bytes > 0


def test_rule3_dense_size_query(monkeypatch):
    """`attention`'s workspace size (the query and the launch share `dense_workspace_bytes`;
    `_dispatch.plan_for` makes the plan with `decode_plan`'s default rule) follows the plan's
    rule: 0 under rule 3 at B = 8, Sk = 1k, Hkv = 32 (one split), rule 2's three splits'
    partials under the default."""
    from cuflash import _checks

    q = np.zeros((8, 32, 1, 128), np.float16)
    k = np.lib.stride_tricks.as_strided(np.zeros((8, 32, 1, 128), np.float16),
                                        (8, 32, 1024, 128), (32 * 256, 256, 0, 2))
    prob = _checks.check_attention(q, k, k, causal=False, scale=None, return_lse=False,
                                   out=None, stream=None, kernel="auto")
    sizes = {}
    for rule in (2, 3):
        monkeypatch.setattr(_decode, "DECODE_SPLIT_RULE", rule)
        plan = _decode.decode_plan("float16", 128, False, False, rows=_decode.dense_rows(prob))
        assert _decode.rule_of(plan) == rule
        sizes[rule] = _decode.dense_workspace_bytes(plan, prob, H200)
    assert sizes[3] == 0 < sizes[2]


@pytest.mark.parametrize("mt", [1, 2])
@pytest.mark.parametrize("per_sm", [1, 2, 3, 4])
def test_rule3_within_the_caps(mt, per_sm):
    """Rule 3's count stays inside the caps every rule has (a key tile per warp, <= 8 waves'
    worth of blocks, <= MAX_SPLITS), so the split partials never exceed what those caps bound
    (entries x MAX_SPLITS x rows x Dpad floats), and it is a function of its arguments only."""
    for work in (1, 3, 8, 64, 256, 2048, 65536):
        for tiles in (1, 3, 4, 5, 64, 513, 8192, 131072):
            s = _decode.choose_splits_v3(work, tiles, 132, per_sm, 8192, 2048, mt)
            assert s == _decode.choose_splits(work, tiles, 132, per_sm, 8192, 2048, version=2,
                                              rule=3, mt=mt)
            slots = 132 * per_sm
            assert 1 <= s <= min(_decode.MAX_SPLITS, max(1, -(-tiles // 4)),
                                 max(1, -(-8 * slots // work)))


def test_rule3_sees_changed_constants(monkeypatch):
    """Rule 3's count is cached per model constants too: a combine costlier than any split
    gives one split at once; a free one a split count past one."""
    assert _decode.choose_splits_v3(8, 8192, 132, 3, 8192, 2048, 1) > 1
    monkeypatch.setattr(_decode, "DECODE_T_COMBINE_V3", 1.0)
    assert _decode.choose_splits_v3(8, 8192, 132, 3, 8192, 2048, 1) == 1


def test_rules_plans_and_labels():
    """The rule is part of the plan: rule 3's label ends in ",rule3" (after a version's
    suffix), its kernel is rule 2's (one compiled specialisation); version 1 keeps its own rule
    whatever is asked; an unknown rule is refused; rule_of reads the label back."""
    for v in (2, 3, 4):
        p2 = _decode.decode_plan("bfloat16", 128, True, True, rows=32, version=v, rule=2)
        p3 = _decode.decode_plan("bfloat16", 128, True, True, rows=32, version=v, rule=3)
        assert p2.label != p3.label and p3.label == p2.label[:-1] + ",rule3>"
        assert p2.spec == p3.spec and (_decode.rule_of(p2), _decode.rule_of(p3)) == (2, 3)
    p1 = _decode.decode_plan("float16", 64, False, False, version=1, rule=3)
    assert p1.label.endswith(",v1>") and _decode.rule_of(p1) == 2
    cfg = _decode.configure(p1, (1, 8, 32), 1, 1, 1024, 64, H200)
    assert cfg.splits == _decode.choose_splits(256, 64, 132, _decode.blocks_per_sm(p1, 64),
                                               2 * 16 * 64 * 2, 256, version=1)
    with pytest.raises(ValueError, match="split rules"):
        _decode.decode_plan("float16", 64, False, False, rule=5)
    p4 = _decode.decode_plan("float16", 64, False, False, rule=4)
    assert p4.label.endswith(",rule4>") and _decode.rule_of(p4) == 4


def test_version7_stages_and_shared_memory():
    """Version 7 has three K/V stages per warp at MT = 2 only (MT = 1 keeps version 2's two, so
    its plan's shared memory is version 2's); at D = 128, MT = 2 the third stage (4 warps x 16
    keys x 136 x 2 B x 2, K and V) still leaves two blocks per SM, which is what the registers
    allow, so the split rule sees the same slots as for version 2."""
    assert [_decode.decode_stages(v, mt) for v in (2, 6, 7) for mt in (1, 2)] == [2, 2, 2, 2, 2, 3]
    for dpad in (64, 128):
        v2 = _decode.decode_plan("float16", dpad, False, False, rows=32, version=2)
        v7 = _decode.decode_plan("float16", dpad, False, False, rows=32, version=7)
        stage = 4 * 2 * 16 * (dpad + 8) * 2
        assert v7.smem_bytes == v2.smem_bytes + stage
        assert _decode.blocks_per_sm(v7, dpad) == _decode.blocks_per_sm(v2, dpad)
        one = [_decode.decode_plan("float16", dpad, True, True, rows=4, version=v)
               for v in (2, 7)]
        assert one[0].smem_bytes == one[1].smem_bytes and one[0].block_m == 16
    assert _decode.decode_plan("float16", 128, False, False, rows=32, version=7).smem_bytes \
        == 32 * 136 * 2 + 3 * 4 * 2 * 16 * 136 * 2 == 113152


@pytest.mark.parametrize("dpad", [64, 128, 256])
def test_version6_swizzle_reads_what_it_wrote(dpad):
    """Decode version 6's shared-memory layout (attn_decode.cu: load_kv_tile's SW, the ldmatrix
    addresses): chunk c of key row r is written at chunk c ^ (r & 7) of a row DPAD elements
    long; each lane's ldmatrix address, formed as the kernel forms it ((2 kk) ^ ((lm % 2) ^ lr)
    for K, (2 nn) ^ ((lm / 2) ^ lr) for V), finds the chunk the mma fragment needs; the eight
    addresses of each 8x8 matrix fall in eight different 16-byte bank groups (no conflicts); and
    the eight lanes that copy one 128-byte global line write one aligned 128-byte segment."""
    chunks, bn = dpad // 8, 16
    where = {}
    for r in range(bn):
        for c in range(chunks):
            where[(r, c)] = r * dpad * 2 + ((c ^ (r & 7)) * 16)     # bytes
    assert len(set(where.values())) == bn * chunks                 # a bijection onto the tile
    for r in range(bn):                                            # a global line's 8 chunks
        for line in range(chunks // 8):
            segs = {where[(r, 8 * line + j)] // 128 for j in range(8)}
            assert len(segs) == 1
    for lane in range(32):
        lr, lm = lane % 8, lane // 8
        ky, vy = (lm % 2) ^ lr, (lm // 2) ^ lr
        k_off, v_off = (lr + 8 * (lm // 2)) * dpad * 2, (lr + 8 * (lm % 2)) * dpad * 2
        for kk in range(dpad // 16):          # K: row lr + 8 (lm / 2), chunk 2 kk + lm % 2
            addr = k_off + (((2 * kk) ^ ky) << 4)
            assert addr == where[(lr + 8 * (lm // 2), 2 * kk + lm % 2)]
        for nn in range(dpad // 16):          # V (trans): row lr + 8 (lm % 2), chunk 2 nn + lm / 2
            addr = v_off + (((2 * nn) ^ vy) << 4)
            assert addr == where[(lr + 8 * (lm % 2), 2 * nn + lm // 2)]
    for kk in range(dpad // 16):              # each matrix's 8 rows: 8 distinct bank groups
        for lm in range(4):
            groups = {((lr + 8 * (lm // 2)) * dpad * 2 + (((2 * kk) ^ ((lm % 2) ^ lr)) << 4))
                      % 128 // 16 for lr in range(8)}
            assert len(groups) == 8
