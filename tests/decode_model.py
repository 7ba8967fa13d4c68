"""A NumPy model of the decode kernel's work split (kernels_cu/attn_decode.cu): row blocks of
16 MT packed rows, key splits, warps walking tiles t % NWARPS of their split with an online
softmax each, the warp merge in warp order, the split partials and the combine over split
groups. It follows the kernel's index arithmetic (which rows a block owns, the keys its last
query row sees under a causal mask, the partial rows' addresses) so the CPU tests can check
that arithmetic against the float64 reference for every group size, split count and MT; the
numerics are float32 with P rounded to the input dtype before P.V, as on the tensor cores."""
import numpy as np

from cuflash import _decode, reference


def decode_model(q, k, v, *, causal, scale, mt, splits=None, sm_count=132,
                 dtype="float16", nwarps=_decode.DECODE_WARPS, bn=_decode.DECODE_BN,
                 version=None):
    """o (G, Sq, D) and lse (G, Sq) of one (batch, kv head) entry: q (G, Sq, D) (query head j
    of the group, query i), k and v (Sk, D). `splits`: None for `configure`'s choice, or a
    forced count (capped as `configure` caps it: at most one split per key tile). `version`:
    the kernels' (None: _decode.DECODE_VERSION): the split rule and the combine's split groups.
    Returns (o, lse, splits used)."""
    version = _decode.DECODE_VERSION if version is None else version
    g, sq, d = q.shape
    sk = k.shape[0]
    rows = g * sq
    rb_rows = 16 * mt
    n_rblocks = -(-rows // rb_rows)
    n_rtiles = n_rblocks * mt
    n_key_tiles = -(-sk // bn)
    if splits is None:
        dpad = _decode.head_dim_bucket(d, _decode.DECODE_DPADS)
        plan = _decode.decode_plan(dtype, d, causal, False, rows=32 if mt == 2 else 1,
                                   version=version)
        splits = _decode.choose_splits(n_rblocks, n_key_tiles, sm_count,
                                       _decode.blocks_per_sm(plan, dpad), 2 * bn * dpad * 2,
                                       min(rows, rb_rows) * dpad * 4, version=version)
    split_tiles = max(1, -(-n_key_tiles // splits))
    splits = max(1, -(-n_key_tiles // split_tiles))
    rpad = 16 * n_rtiles
    qp = np.zeros((rpad, d), np.float32)          # packed rows r = i * G + j
    for r in range(rows):
        qp[r] = q[r % g, r // g]
    kf, vf = k.astype(np.float32), v.astype(np.float32)
    c = np.float32(scale * _decode._LOG2E)
    o_part = np.full((splits, rpad, d), np.nan, np.float32)
    lse_part = np.full((splits, rpad), np.nan, np.float32)
    diag = sk - sq
    for rb in range(n_rblocks):
        r0 = rb * rb_rows
        if r0 >= rows:
            continue
        rr = np.arange(r0, r0 + rb_rows)
        qi = rr // g
        last_q = min(sq - 1, (min(r0 + rb_rows, rows) - 1) // g)
        keys = max(0, min(sk, last_q + sk - sq + 1)) if causal else sk
        n_tiles = -(-keys // bn)
        for split in range(splits):
            t_begin = split * split_tiles
            t_end = min(n_tiles, t_begin + split_tiles)
            states = []
            for w in range(nwarps):       # each warp: its own online softmax over its tiles
                m = np.full(rb_rows, -np.inf, np.float32)
                lsum = np.zeros(rb_rows, np.float32)
                acc = np.zeros((rb_rows, d), np.float32)
                for t in range(t_begin + w, t_end, nwarps):
                    key = np.arange(t * bn, t * bn + bn)
                    kt = np.zeros((bn, d), np.float32)
                    vt = np.zeros((bn, d), np.float32)
                    ok_k = key < sk
                    kt[ok_k], vt[ok_k] = kf[key[ok_k]], vf[key[ok_k]]
                    s = qp[rr] @ kt.T
                    ok = ok_k[None, :] & np.ones((rb_rows, 1), bool)
                    if causal:
                        ok = ok & (key[None, :] <= (qi + diag)[:, None])
                    s = np.where(ok, s, -np.inf).astype(np.float32)
                    mx = np.maximum(m, s.max(axis=1))
                    with np.errstate(invalid="ignore"):
                        grow = (mx - m) * c > 0
                        alpha = np.where(grow, np.exp2((m - mx) * c), np.float32(1))
                    m = np.where(grow, mx, m)
                    m_c = np.where(np.isneginf(m), np.float32(0), m * c)
                    p = np.exp2(s * c - m_c[:, None]).astype(np.float32)
                    lsum = lsum * alpha + p.sum(axis=1)
                    acc = acc * alpha[:, None]
                    p16 = reference.round_to(p, dtype).astype(np.float32)
                    acc = acc + p16 @ vt
                states.append((np.where(np.isneginf(m), m, m * c), lsum, acc))
            # the warps' merge, in warp order
            mx = np.max([st[0] for st in states], axis=0)
            lt = np.zeros(rb_rows, np.float32)
            at = np.zeros((rb_rows, d), np.float32)
            live = ~np.isneginf(mx)
            for mw, lw, aw in states:
                with np.errstate(invalid="ignore"):
                    f = np.where(np.isneginf(mw) | ~live, np.float32(0), np.exp2(mw - mx))
                lt += f * lw
                at += f[:, None] * aw
            with np.errstate(divide="ignore", invalid="ignore"):
                val = np.where((lt > 0)[:, None], at / lt[:, None], np.float32(0))
                lse = np.where(lt > 0, (mx + np.log2(lt)) * np.float32(np.log(2)), -np.inf)
            valid = rr < rows
            o_part[split, rr[valid]] = val[valid]
            lse_part[split, rr[valid]] = lse[valid]
    if splits == 1:
        o_rows, lse_rows = o_part[0], lse_part[0]
    else:   # the combine: weights from the split lse, groups of splits summed in group order
        # split groups: 128 threads over the row's (version 2: the column block's) chunks
        dpad = _decode.head_dim_bucket(d, _decode.DECODE_DPADS)
        ng = 128 * _decode.combine_columns(
            splits, dpad, _decode.combine_version(version, splits, dpad)) // (dpad // 4)
        o_rows = np.zeros((rpad, d), np.float32)
        lse_rows = np.zeros(rpad, np.float32)
        for r in range(rows):
            ls = lse_part[:, r]
            mx = ls.max()
            tot = np.float32(0) if np.isneginf(mx) else np.exp(ls - mx).sum(dtype=np.float32)
            w = np.where((tot > 0) & ~np.isneginf(ls), np.exp(ls - mx) / tot if tot > 0 else 0, 0)
            acc = np.zeros(d, np.float32)
            for gi in range(ng):
                acc += (w[gi::ng, None] * o_part[gi::ng, r]).sum(axis=0)
            o_rows[r] = acc
            lse_rows[r] = mx + np.log(tot) if tot > 0 else -np.inf
    o = np.full((g, sq, d), np.nan)
    lse = np.full((g, sq), np.nan)
    for r in range(rows):
        o[r % g, r // g] = o_rows[r]
        lse[r % g, r // g] = lse_rows[r]
    return o, lse, splits
