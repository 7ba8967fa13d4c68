"""Shared by the varlen tests: packed random batches and the per-sequence float64 check."""
import numpy as np

from cuflash import reference


def make_varlen(rng, lens_q, lens_k, h, hkv, d, dtype):
    """(q, k, v, cu_q, cu_k) float64 arrays holding `dtype` values, packed with no gaps."""
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    q = reference.round_to(rng.standard_normal((int(cu_q[-1]), h, d)), dtype)
    k = reference.round_to(rng.standard_normal((int(cu_k[-1]), hkv, d)), dtype)
    v = reference.round_to(rng.standard_normal((int(cu_k[-1]), hkv, d)), dtype)
    return q, k, v, cu_q, cu_k


def check_varlen_result(o, lse, q, k, v, cu_q, cu_k, *, causal, dtype, skip=()):
    """Each sequence of o (total_q, H, Dv) under the pass rule; lse (H, total_q) tightly.
    Sequences in `skip` (indices) are not judged, and rows past cu_q[-1] not looked at."""
    n = int(cu_q[-1])
    keep = np.ones(n, bool)
    for s in skip:
        keep[int(cu_q[s]):int(cu_q[s + 1])] = False
    o, lse = o[:n][keep], lse[:, :n][:, keep]
    assert not np.isnan(o).any(), f"{int(np.isnan(o).sum())} output elements NaN (unwritten?)"
    assert not np.isnan(lse).any(), "lse has NaN (unwritten?)"
    o_ref, lse_ref = reference.attention_varlen_ref(q, k, v, cu_q, cu_k, causal=causal)
    o_ref, lse_ref = o_ref[:n][keep], lse_ref[:, :n][:, keep]
    rows = np.cumsum(keep) - 1   # row of the packed batch -> row of the kept arrays
    for s in range(cu_q.size - 1):
        q0, q1, k0, k1 = (int(x) for x in (cu_q[s], cu_q[s + 1], cu_k[s], cu_k[s + 1]))
        if q1 == q0 or s in skip:
            continue
        q0, q1 = int(rows[q0]), int(rows[q1 - 1]) + 1
        k0, k1 = int(cu_k[s]), int(cu_k[s + 1])
        if k1 == k0:
            assert np.all(o[q0:q1] == 0) and np.all(np.isneginf(lse[:, q0:q1]))
            continue
        qs = q[int(cu_q[s]):int(cu_q[s + 1])]
        qt, kt, vt = (x.transpose(1, 0, 2) for x in (qs, k[k0:k1], v[k0:k1]))
        rule = reference.pass_threshold(qt, kt, vt, causal=causal, dtype=dtype,
                                        o_ref=o_ref[q0:q1].transpose(1, 0, 2))
        verdict = rule.judge(o[q0:q1].transpose(1, 0, 2))
        assert verdict.passed, f"sequence {s} ({q1 - q0} x {k1 - k0}): " + "; ".join(
            verdict.reasons)
    fin = np.isfinite(lse_ref)
    assert np.array_equal(np.isneginf(lse), ~fin), "lse = -inf exactly where no key is visible"
    err = np.abs(lse[fin] - lse_ref[fin])
    assert np.all(err <= 1e-4 + 1e-5 * np.abs(lse_ref[fin])), f"lse error {err.max():.3e}"


def check_varlen_grads(grads, do, q, k, v, cu_q, cu_k, *, causal, dtype):
    """Each sequence's dq, dk, dv (packed layouts) under the gradient pass rule
    (`reference.grad_pass_threshold` on that sequence); rows of sequences with no key or no
    query exactly 0; no NaN anywhere in the sequences' rows (NaN-poisoned outputs fail)."""
    got = [np.asarray(g).astype(np.float64) for g in grads]
    nq, nk = int(cu_q[-1]), int(cu_k[-1])
    for name, g, n in zip(("dq", "dk", "dv"), got, (nq, nk, nk)):
        assert not np.isnan(g[:n]).any(), f"{name}: {int(np.isnan(g[:n]).sum())} NaN (unwritten?)"
    for s in range(cu_q.size - 1):
        q0, q1, k0, k1 = (int(x) for x in (cu_q[s], cu_q[s + 1], cu_k[s], cu_k[s + 1]))
        if q1 == q0 or k1 == k0:
            assert np.all(got[0][q0:q1] == 0) and np.all(got[1][k0:k1] == 0) \
                and np.all(got[2][k0:k1] == 0), f"sequence {s} ({q1 - q0} x {k1 - k0}) not 0"
            continue
        seg = [x.transpose(1, 0, 2) for x in (do[q0:q1], q[q0:q1], k[k0:k1], v[k0:k1])]
        g_ref = reference.attention_backward_ref(*seg, causal=causal)
        tols, naive = reference.grad_pass_threshold(*seg, causal=causal, dtype=dtype, ref=g_ref)
        for name, g, r, tol, ne, lo, hi in zip(("dq", "dk", "dv"), got, g_ref, tols, naive,
                                               (q0, k0, k0), (q1, k1, k1)):
            err = float(np.max(np.abs(g[lo:hi].transpose(1, 0, 2) - r)))
            assert err <= tol, (f"sequence {s} ({q1 - q0} x {k1 - k0}) {name}: max abs error "
                                f"{err:.3e} > threshold {tol:.3e} (naive {dtype}: {ne:.3e})")
