"""Shared by the KV-cache tests (CPU and GPU): random caches (contiguous or paged, pages
shuffled), ragged lengths, and the per-sequence float64 check with the project's pass rule."""
import numpy as np

from cuflash import reference


def make_cache(rng, *, b, hkv, d, lens, snew, page, dtype, spare_pages=3):
    """(k_cache, v_cache, block_table or None) as float64 arrays holding `dtype` values; each
    sequence has room for its length plus `snew`, in shuffled pages when `page` is not None."""
    cap = max(int(max(lens)) + snew, 1)
    if page is None:
        shape = (b, cap + 5, hkv, d)
        bt = None
    else:
        per = -(-cap // page)
        n = b * per + spare_pages
        shape = (n, page, hkv, d)
        bt = rng.permutation(n)[:b * per].reshape(b, per).astype(np.int32)
    k = reference.round_to(rng.standard_normal(shape), dtype)
    v = reference.round_to(rng.standard_normal(shape), dtype)
    return k, v, bt


def check_kvcache_result(o, lse, q, k_cache, v_cache, lens, *, block_table, k_new, v_new,
                         causal, dtype):
    """Each sequence's o (B, Sq, H, Dv) against the float64 reference under the pass rule; a
    sequence with no key must give exactly 0 and lse -inf. o, lse: float64 host arrays."""
    b, sq, h, _ = q.shape
    assert not np.isnan(o).any(), f"{int(np.isnan(o).sum())} output elements NaN (unwritten?)"
    assert not np.isnan(lse).any(), "lse has NaN (unwritten?)"
    o_ref, lse_ref = reference.attention_with_kvcache_ref(
        q, k_cache, v_cache, lens, block_table=block_table, k_new=k_new, v_new=v_new,
        causal=causal)
    snew = 0 if k_new is None else k_new.shape[1]
    for i in range(b):
        n = int(lens[i]) + snew
        if n == 0:
            assert np.all(o[i] == 0) and np.all(np.isneginf(lse[i])), f"sequence {i} is empty"
            continue
        k_i, v_i = reference.gather_kv_cache(k_cache, v_cache, int(lens[i]), i, block_table)
        if snew:
            k_i = np.concatenate([k_i, k_new[i]])
            v_i = np.concatenate([v_i, v_new[i]])
        qt, kt, vt = q[i].transpose(1, 0, 2), k_i.transpose(1, 0, 2), v_i.transpose(1, 0, 2)
        rule = reference.pass_threshold(qt, kt, vt, causal=causal, dtype=dtype,
                                        o_ref=o_ref[i].transpose(1, 0, 2))
        verdict = rule.judge(o[i].transpose(1, 0, 2))
        assert verdict.passed, f"sequence {i} (length {n}): " + "; ".join(verdict.reasons)
        fin = np.isfinite(lse_ref[i])
        assert np.array_equal(np.isneginf(lse[i]), ~fin), f"sequence {i}: lse -inf pattern"
        err = np.abs(lse[i][fin] - lse_ref[i][fin])
        assert np.all(err <= 1e-4 + 1e-5 * np.abs(lse_ref[i][fin])), f"lse error {err.max():.3e}"


def check_appended(k_cache, v_cache, lens, k_new, v_new, *, block_table, what="append"):
    """The caches (host arrays, after a call with k_new/v_new) hold k_new[b], v_new[b] at keys
    lens[b] .. lens[b] + Snew - 1 of each sequence b (through the block table when paged)."""
    snew = k_new.shape[1]
    for i in range(len(lens)):
        k_i, v_i = reference.gather_kv_cache(k_cache, v_cache, int(lens[i]) + snew, i,
                                             block_table)
        np.testing.assert_array_equal(k_i[lens[i]:], k_new[i], f"{what}: k of sequence {i}")
        np.testing.assert_array_equal(v_i[lens[i]:], v_new[i], f"{what}: v of sequence {i}")


def random_kv_problem(rng, *, b, hkv, group, sq, d, lens, snew, page, dtype):
    """(q, k_cache, v_cache, block_table or None, k_new or None, v_new or None): float64 host
    arrays holding `dtype` values, q (B, Sq, Hkv * group, D), caches from `make_cache`."""
    k, v, bt = make_cache(rng, b=b, hkv=hkv, d=d, lens=lens, snew=snew, page=page, dtype=dtype)
    q = reference.round_to(rng.standard_normal((b, sq, hkv * group, d)), dtype)
    kn = vn = None
    if snew:
        kn, vn = (reference.round_to(rng.standard_normal((b, snew, hkv, d)), dtype)
                  for _ in range(2))
    return q, k, v, bt, kn, vn
