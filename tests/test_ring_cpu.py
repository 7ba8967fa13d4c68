"""The ring attention schedule (cuflash.ring) in the CPU simulation: every rank a NumPy shard,
the ring a loop, cuflash's NumPy attention per shard pair. Forward and backward against the
float64 references under the project's pass rules, for 1 to 8 ranks (odd counts too), causal
and not, sequence lengths that 2R divides and tails that it does not; the zigzag split's
coverage and balance; the asynchronous discipline (no receive buffer read before its wait)."""
import itertools

import numpy as np
import pytest

from cuflash import reference, ring
from cuflash.ring.transport import SimTransport

try:
    import ml_dtypes  # noqa: F401

    HAVE_BF16 = True
except ImportError:  # pragma: no cover
    HAVE_BF16 = False

WORLDS = [1, 2, 3, 4, 5, 8]
LSE_TOL = (1e-4, 1e-5)  # |lse error| <= 1e-4 + 1e-5 |lse|, as tests/gpu_util.py holds the GPU's


def _as(x64, dtype):
    return x64.astype(np.dtype(dtype))


def _inputs(rng, batch_q, batch_kv, s, d, dv, dtype):
    q = reference.round_to(rng.standard_normal(batch_q + (s, d)), dtype)
    k = reference.round_to(rng.standard_normal(batch_kv + (s, d)), dtype)
    v = reference.round_to(rng.standard_normal(batch_kv + (s, dv)), dtype)
    return q, k, v


def _seq_lens(world):
    """One length 2R divides and one it does not (a tail: chunks of unequal length)."""
    return [6 * 2 * world, 6 * 2 * world + 2 * world - 1 if world > 1 else 13]


def _check_forward(o, lse, q, k, v, *, causal, dtype, scale=None):
    o_ref, lse_ref = reference.attention_ref(q, k, v, causal=causal, scale=scale)
    rule = reference.pass_threshold(q, k, v, causal=causal, scale=scale, dtype=dtype,
                                    o_ref=o_ref)
    assert o.dtype == np.dtype(dtype) and o.shape == o_ref.shape
    verdict = rule.judge(o.astype(np.float64))
    assert verdict.passed, "; ".join(verdict.reasons)
    assert lse.dtype == np.float32 and lse.shape == lse_ref.shape
    err = np.abs(lse.astype(np.float64) - lse_ref)
    assert np.all(err <= LSE_TOL[0] + LSE_TOL[1] * np.abs(lse_ref)), f"lse error {err.max():.3e}"


@pytest.mark.parametrize("world,causal,tail,dtype", [
    (w, c, t, dt) for w, c, t, dt in itertools.product(WORLDS, [False, True], [False, True],
                                                       ["float16", "float32"])])
def test_forward_matches_reference(world, causal, tail, dtype):
    rng = np.random.default_rng([world, causal, tail, len(dtype)])
    s = _seq_lens(world)[tail]
    q, k, v = _inputs(rng, (2, 3), (2, 3), s, 16, 8, dtype)
    o, lse = ring.ring_attention_local(_as(q, dtype), _as(k, dtype), _as(v, dtype), world=world,
                                       causal=causal, return_lse=True)
    _check_forward(o, lse, q, k, v, causal=causal, dtype=dtype)


@pytest.mark.skipif(not HAVE_BF16, reason="ml_dtypes not installed: no bfloat16 on the CPU")
@pytest.mark.parametrize("world,causal", [(3, True), (4, False), (8, True)])
def test_forward_bfloat16_broadcast_heads(world, causal):
    """bfloat16, a key/value head shared by the query heads (multi-query), a scale."""
    rng = np.random.default_rng([world, causal, 16])
    s = 2 * world * 5 + 3
    q, k, v = _inputs(rng, (2, 4), (2, 1), s, 24, 16, "bfloat16")
    o, lse = ring.ring_attention_local(_as(q, "bfloat16"), _as(k, "bfloat16"), _as(v, "bfloat16"),
                                       world=world, causal=causal, scale=0.3, return_lse=True)
    _check_forward(o, lse, q, k, v, causal=causal, dtype="bfloat16", scale=0.3)


def _check_backward(grads, do, q, k, v, *, causal, dtype, scale=None):
    g_ref = reference.attention_backward_ref(do, q, k, v, causal=causal, scale=scale)
    tols, _ = reference.grad_pass_threshold(do, q, k, v, causal=causal, scale=scale, dtype=dtype,
                                            ref=g_ref)
    for name, g, r, tol in zip(("dq", "dk", "dv"), grads, g_ref, tols):
        assert g.shape == r.shape and g.dtype == np.dtype(dtype), name
        err = np.abs(g.astype(np.float64) - r).max()
        assert err <= tol, f"{name}: max abs error {err:.3e} > threshold {tol:.3e}"


@pytest.mark.parametrize("world,causal,tail", list(itertools.product(WORLDS, [False, True],
                                                                     [False, True])))
def test_backward_matches_reference(world, causal, tail):
    _run_backward(np.random.default_rng([world, causal, tail, 7]), world, causal,
                  _seq_lens(world)[tail], (2, 2), (2, 2), 16, 8, "float16")


def _run_backward(rng, world, causal, s, batch_q, batch_kv, d, dv, dtype):
    """Forward then backward through the ring simulation, judged against float64."""
    q, k, v = _inputs(rng, batch_q, batch_kv, s, d, dv, dtype)
    do = reference.round_to(
        rng.standard_normal(np.broadcast_shapes(batch_q, batch_kv) + (s, dv)), dtype)
    args = [_as(x, dtype) for x in (q, k, v)]
    o, lse = ring.ring_attention_local(*args, world=world, causal=causal, return_lse=True)
    grads = ring.ring_attention_backward_local(_as(do, dtype), *args, o, lse, world=world,
                                               causal=causal)
    _check_backward(grads, do, q, k, v, causal=causal, dtype=dtype)


@pytest.mark.skipif(not HAVE_BF16, reason="ml_dtypes not installed: no bfloat16 on the CPU")
@pytest.mark.parametrize("world,causal", [(2, True), (5, False), (5, True)])
def test_backward_bfloat16_shared_kv_head(world, causal):
    """Gradients of a shared key/value head are summed over the query heads, across the ring."""
    _run_backward(np.random.default_rng([world, causal, 9]), world, causal, 2 * world * 4 + 1,
                  (1, 3), (1, 1), 8, 16, "bfloat16")


# ---------------------------------------------------------------------------------------------
# The zigzag split and the per-pair calls

@pytest.mark.parametrize("world", list(range(1, 9)))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seq_len", ["even", "tail"])
def test_pair_calls_cover_the_mask_exactly(world, causal, seq_len):
    """Over the ring, every (query, key) pair the mask allows is visited exactly once and no
    masked pair at all: mark every call's score block in the global (S x S) matrix."""
    s = 4 * 2 * world if seq_len == "even" else 4 * 2 * world + world + 1
    lay = ring.ZigzagLayout(s, world)
    count = np.zeros((s, s), dtype=np.int64)
    for r in range(world):
        q_rows = np.concatenate([np.arange(s)[sl] for sl in lay.shard_slices(r)])
        n0 = lay.half_len(r, 0)
        for t in range(world):
            j = (r - t) % world
            k_rows = np.concatenate([np.arange(s)[sl] for sl in lay.shard_slices(j)])
            for c in ring.pair_calls(lay, r, j, causal):
                qr = q_rows[:n0] if c.half == 0 else q_rows[n0:]
                kr = k_rows[c.k0:c.k1]
                vis = np.ones((qr.size, kr.size), dtype=bool)
                if c.causal:  # bottom-right aligned, as cuflash.attention's mask
                    vis = np.tril(vis, kr.size - qr.size)
                np.add.at(count, (qr[:, None].repeat(kr.size, 1)[vis],
                                  kr[None, :].repeat(qr.size, 0)[vis]), 1)
    want = np.tril(np.ones((s, s), dtype=np.int64)) if causal else np.ones((s, s), np.int64)
    np.testing.assert_array_equal(count, want)


@pytest.mark.parametrize("world", list(range(1, 9)))
def test_zigzag_balances_causal_work(world):
    """With 2R dividing S every rank visits the same number of score elements at every ring
    step (steps are synchronous, so a rank with less work would idle); with a tail the spread
    is at most the few rows the unequal chunks add. A contiguous split (rank r holding rows
    [r S/R, (r+1) S/R)) is far from it, which this measure sees."""
    c = 8
    s = 2 * world * c
    lay = ring.ZigzagLayout(s, world)
    for causal in (False, True):
        work = ring.step_work(lay, causal)
        for t, row in enumerate(work):
            assert len(set(row)) == 1, f"step {t}: work per rank {row}"
        total = sum(map(sum, work))
        assert total == (s * (s + 1) // 2 if causal else s * s)
    tail = ring.step_work(ring.ZigzagLayout(s + world + 1, world), True)
    per_rank = [sum(w[r] for w in tail) for r in range(world)]
    assert max(per_rank) - min(per_rank) <= 2 * (s + world + 1) + 4 * c, per_rank
    if world > 1:  # the contiguous split, counted the same way (query block r, key block j)
        n = s // world
        contiguous = [sum(n * n if j < r else (n * (n + 1) // 2 if j == r else 0)
                          for j in range(world)) for r in range(world)]
        assert max(contiguous) > 2.5 * min(contiguous), contiguous  # -> 2R - 1 as S grows


def test_layout_shard_unshard_roundtrip():
    x = np.arange(2 * 37 * 3, dtype=np.float32).reshape(2, 37, 3)
    for world in (1, 3, 5, 8, 18):
        shards = [ring.shard(x, world=world, rank=r) for r in range(world)]
        assert sum(s.shape[-2] for s in shards) == 37
        np.testing.assert_array_equal(ring.unshard(shards), x)
    bounds = ring.chunk_bounds(37, 3)
    assert [b - a for a, b in bounds] == [7, 6, 6, 6, 6, 6]


def test_refuses_what_it_cannot_do():
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 10, 8)).astype(np.float16) for _ in range(3))
    with pytest.raises(ValueError, match="at least 2 \\* world"):
        ring.ring_attention_local(q, k, v, world=6)
    with pytest.raises(ValueError, match="world"):
        ring.ring_attention_local(q, k, v, world=0)
    with pytest.raises(ValueError, match="must be equal"):
        ring.ring_attention_local(q, k[:, :8], v[:, :8], world=2)
    with pytest.raises(TypeError, match="float64 is not supported"):
        ring.ring_attention_local(*(x.astype(np.float64) for x in (q, k, v)), world=2)
    f32 = [x.astype(np.float32) for x in (q, k, v)]
    o, lse = ring.ring_attention_local(*f32, world=2, return_lse=True)
    with pytest.raises(TypeError, match="backward: dtype float32"):
        ring.ring_attention_backward_local(o, *f32, o, lse, world=2)
    with pytest.raises(ValueError, match="rank 0's shard has 10 rows"):
        ring.ring_attention(q, k, v, transport=_OneOfTwo(), seq_len=13)


class _OneOfTwo(SimTransport):
    def __init__(self):
        super().__init__(2)
        self.local_ranks = (0,)


# ---------------------------------------------------------------------------------------------
# The schedule's asynchronous discipline, and the shard-level entry point

class DeferredTransport(SimTransport):
    """A shift that only happens at `wait`: until then every receive buffer holds NaN. A
    schedule that read a buffer before waiting for it, or wrote a send buffer between the
    shift and its wait, would produce NaN or a wrong result."""

    def shift(self, send, recv):
        pending = []
        for r in self.local_ranks:
            for src, dst in zip(send[r], recv[(r + 1) % self.world]):
                pending.append((src, dst, src.copy()))
                dst[...] = np.nan
        return pending

    def wait(self, handle):
        for src, dst, snapshot in handle or ():
            np.testing.assert_array_equal(src, snapshot)  # the send buffer was left alone
            dst[...] = src


@pytest.mark.parametrize("world,causal", [(3, True), (4, False)])
def test_schedule_waits_before_reading(world, causal):
    dtype = "float16"
    rng = np.random.default_rng([world, 3])
    s = 2 * world * 4 + 3
    q, k, v = _inputs(rng, (2,), (2,), s, 8, 8, dtype)
    do = reference.round_to(rng.standard_normal((2, s, 8)), dtype)
    tr = DeferredTransport(world)
    sh = {n: [ring.shard(_as(x, dtype), world=world, rank=r) for r in range(world)]
          for n, x in (("q", q), ("k", k), ("v", v), ("do", do))}
    o, lse = ring.ring_attention(sh["q"], sh["k"], sh["v"], transport=tr, causal=causal,
                                 seq_len=s, return_lse=True)
    _check_forward(ring.unshard(o), ring.unshard([x[..., None] for x in lse])[..., 0], q, k, v,
                   causal=causal, dtype=dtype)
    grads = ring.ring_attention_backward(sh["do"], sh["q"], sh["k"], sh["v"], o, lse,
                                         transport=tr, causal=causal, seq_len=s)
    _check_backward([ring.unshard(g) for g in grads], do, q, k, v, causal=causal, dtype=dtype)


# ---------------------------------------------------------------------------------------------
# The launcher (its NCCL part needs GPUs: tests/test_ring_nccl.py)

def test_launcher_environment_and_exit_status(tmp_path):
    """Every child gets its rank, the world, the id and one visible device; a failing child's
    status is returned and the others are stopped."""
    from cuflash.ring import launch

    script = tmp_path / "child.py"
    script.write_text(
        "import os, sys, time\n"
        "r = int(os.environ['CUFLASH_RING_RANK'])\n"
        "open(os.path.join(sys.argv[1], f'{r}.txt'), 'w').write(' '.join(\n"
        "    [os.environ['CUFLASH_RING_WORLD'], os.environ['CUFLASH_RING_NCCL_ID'],\n"
        "     os.environ['CUDA_VISIBLE_DEVICES']]))\n"
        "if len(sys.argv) > 2 and r == int(sys.argv[2]): sys.exit(3)\n"
        "if len(sys.argv) > 2: time.sleep(60)\n")
    uid = tuple(range(-3, 5))
    assert launch.launch(3, str(script), [str(tmp_path)], devices=[5, 6, 7], unique_id=uid) == 0
    for r in range(3):
        world, ident, dev = (tmp_path / f"{r}.txt").read_text().split()
        assert (world, ident, dev) == ("3", ",".join(map(str, uid)), str(5 + r))
    assert launch.launch(3, str(script), [str(tmp_path), "1"], unique_id=uid, timeout=30) == 3


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("extra", [0, 1, 7])
def test_forward_shortest_sequences(world, extra):
    """S = 2R (one row per chunk: every diagonal block 1 x 1) and a few rows more."""
    rng = np.random.default_rng([world, extra, 5])
    s = 2 * world + extra
    for causal in (False, True):
        q, k, v = _inputs(rng, (3,), (3,), s, 8, 8, "float16")
        o, lse = ring.ring_attention_local(_as(q, "float16"), _as(k, "float16"),
                                           _as(v, "float16"), world=world, causal=causal,
                                           return_lse=True)
        _check_forward(o, lse, q, k, v, causal=causal, dtype="float16")


def test_selftest_judge_on_simulated_ranks(tmp_path, monkeypatch):
    """The NCCL self-test's assembly and judging, fed by the CPU simulation's per-rank results
    in the files the ranks would write (so that a multi-GPU run can only fail on the GPUs).
    Its first two cases (float16, causal and not, with the backward), to keep CI short."""
    from cuflash.ring import selftest

    world = 2
    cases = selftest._cases(world, True)[:2]
    assert [c[0] for c in cases] == ["float16"] * 2 and all(c[3] for c in cases)
    monkeypatch.setattr(selftest, "_cases", lambda w, quick: cases)
    tr = SimTransport(world)
    for i, (dt, causal, s, bwd) in enumerate(selftest._cases(world, True)):
        x64 = selftest._inputs(i, dt, s)
        q, k, v, do = ([ring.shard(_as(x, dt), world=world, rank=r) for r in range(world)]
                       for x in x64)
        o, lse = ring.ring_attention(q, k, v, transport=tr, causal=causal, seq_len=s,
                                     return_lse=True)
        res = [{"o": o[r], "lse": lse[r]} for r in range(world)]
        if bwd:
            grads = ring.ring_attention_backward(do, q, k, v, o, lse, transport=tr,
                                                 causal=causal, seq_len=s)
            for r in range(world):
                res[r].update(dq=grads[0][r], dk=grads[1][r], dv=grads[2][r])
        for r in range(world):
            np.savez(tmp_path / f"case{i}_rank{r}.npz",
                     **{n: x.astype(np.float64) for n, x in res[r].items()})
    assert selftest.judge(str(tmp_path), world, True) == []
    np.savez(tmp_path / "case0_rank1.npz", **{n: x * 1.01 for n, x in  # a wrong rank fails
                                               np.load(tmp_path / "case0_rank1.npz").items()})
    assert len(selftest.judge(str(tmp_path), world, True)) == 1
