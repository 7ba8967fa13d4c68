"""A lane-level NumPy model of the tensor-core backward kernel (kernels_cu/attn_bwd_mma.cu:
cuflash_bwd_mma) and of cuflash_bwd_convert_dq, run on the parameter block that
cuflash._launch.launch_backward builds (memory, batch helpers and the preprocess come from
tests/bwd_generic_model.py).

What it models exactly: the PTX semantics of ``ldmatrix.x4`` (with and without ``.trans``) and of
``mma.sync.m16n8k16.row.col`` fragments (which lane holds which element, from the PTX ISA's
fragment tables, written here independently of the kernel), the kernel's shared-memory layout
(offsets, padded row strides, the per-lane ldmatrix addresses of BwdMmaOps), the packing of
accumulators into A fragments (pack_p) and back (unpack_half), the dS^T stores, the dQ split
over warps and chunks, masks, tails, block skipping, the batch loops, the dq accumulator layout
and the turn counters of deterministic mode (checked to be taken densely in key-block order).
With a variant's VariantParams (`vp`: window and softcap, the positional part and the transform
with a derivative; cuflash_bwd_mma_var) it also models the window's tile skipping (the query
tiles a key block visits, from row_range; the tile's last key block for its turn, from
key_range), the per-element visibility and softcap's d score / d t; `visits` collects the
(block, query tile, batch entry) triples visited.
Arithmetic is float64 (no 16-bit rounding), so a layout mistake shows up as a wrong gradient far
above the tolerance.
"""
import numpy as np

from bwd_generic_model import bwd_index, bwd_offsets, prep_rows, preprocess, reduce_count
from cuflash._dispatch import BWD_PREP_ROWS

LANE = np.arange(32)
G, T4 = LANE // 4, LANE % 4


# ---- PTX fragment semantics ---------------------------------------------------------------

def ldmatrix_x4(smem, addr, trans=False):
    """Four 8x8 matrices of 16-bit elements; lane l gives the byte address of row l % 8 of
    matrix l // 8. Returns regs (4, 32, 2): register i of each lane, low half first. Without
    .trans lane t gets row t // 4, columns 2 (t % 4) and 2 (t % 4) + 1 of each matrix; with
    .trans, those of the transposed matrix."""
    addr = np.asarray(addr)
    assert np.all(addr % 16 == 0), "ldmatrix rows must be 16-byte aligned"
    out = np.empty((4, 32, 2))
    for m in range(4):
        rows = addr[8 * m:8 * m + 8] // 2
        mat = smem[rows[:, None] + np.arange(8)[None, :]]
        if trans:
            mat = mat.T
        out[m, :, 0] = mat[G, 2 * T4]
        out[m, :, 1] = mat[G, 2 * T4 + 1]
    return out


def mma(d, a, b0, b1):
    """d (4, 32) += A (16x16, fragments a (4, 32, 2)) @ B (16x8, fragments b0, b1 (32, 2))."""
    A = np.zeros((16, 16))
    B = np.zeros((16, 8))
    C = np.zeros((16, 8))
    for j in range(2):
        A[G, 2 * T4 + j] = a[0][:, j]
        A[G + 8, 2 * T4 + j] = a[1][:, j]
        A[G, 2 * T4 + 8 + j] = a[2][:, j]
        A[G + 8, 2 * T4 + 8 + j] = a[3][:, j]
        B[2 * T4 + j, G] = b0[:, j]
        B[2 * T4 + 8 + j, G] = b1[:, j]
        C[G, 2 * T4 + j] = d[j]
        C[G + 8, 2 * T4 + j] = d[2 + j]
    D = A @ B + C
    for j in range(2):
        d[j] = D[G, 2 * T4 + j]
        d[2 + j] = D[G + 8, 2 * T4 + j]


def pack_p(s):
    """common.cuh pack_p: s (NT, 4, 32) accumulators -> (NT // 2, 4, 32, 2) A fragments."""
    nt = s.shape[0]
    pk = np.empty((nt // 2, 4, 32, 2))
    for kk in range(nt // 2):
        pk[kk, 0] = np.stack([s[2 * kk][0], s[2 * kk][1]], -1)
        pk[kk, 1] = np.stack([s[2 * kk][2], s[2 * kk][3]], -1)
        pk[kk, 2] = np.stack([s[2 * kk + 1][0], s[2 * kk + 1][1]], -1)
        pk[kk, 3] = np.stack([s[2 * kk + 1][2], s[2 * kk + 1][3]], -1)
    return pk


# ---- the kernel ----------------------------------------------------------------------------

class Cfg:
    """BwdMmaConfig."""

    def __init__(self, dpad, bm, bn, nwarps, stages):
        self.dpad, self.bm, self.bn, self.nwarps, self.stages = dpad, bm, bn, nwarps, stages
        assert bn == 16 * nwarps
        self.sd, self.sds = dpad + 8, bm + 8
        self.nt_q, self.nt_d, self.mt_q = bm // 8, dpad // 8, bm // 16
        self.dq_groups = nwarps // self.mt_q
        assert nwarps % self.mt_q == 0
        self.dq_cols = dpad // self.dq_groups
        self.dq_chunk = min(32, self.dq_cols)
        self.k_off, self.v_off = 0, bn * self.sd
        self.q_off = 2 * bn * self.sd
        self.do_off = self.q_off + stages * bm * self.sd
        self.ds_off = self.do_off + stages * bm * self.sd
        self.half_elems = self.ds_off + bn * self.sds
        self.smem_bytes = self.half_elems * 2 + stages * 2 * bm * 4


def _load_tile(mem, smem, off_elems, ptr, base, row0, rows, n_rows, ld, d, stride):
    """load_tile: rows x stride at off_elems, zero beyond n_rows and beyond column d."""
    for r in range(rows):
        dst = off_elems + r * stride
        smem[dst:dst + stride] = 0.0
        if row0 + r < n_rows:
            smem[dst:dst + d] = mem.read(ptr, base + (row0 + r) * ld + np.arange(d))


def _lane_offsets(c):
    """BwdMmaOps: per-lane byte offsets of the four ldmatrix patterns."""
    lr, lm = LANE % 8, LANE // 8
    a_rows = ((lr + 8 * (lm % 2)) * c.sd + 8 * (lm // 2)) * 2
    b_rows = ((lr + 8 * (lm // 2)) * c.sd + 8 * (lm % 2)) * 2
    b_trans = ((lr + 8 * (lm % 2)) * c.sd + 8 * (lm // 2)) * 2
    a_trans_ds = ((lr + 8 * (lm // 2)) * c.sds + 8 * (lm % 2)) * 2
    return a_rows, b_rows, b_trans, a_trans_ds


def _keys_by_rows(smem, c, offs, a_tile, b_tile, nt):
    a_rows, b_rows, _, _ = offs
    acc = np.zeros((nt, 4, 32))
    for kk in range(c.dpad // 16):
        a = ldmatrix_x4(smem, a_tile + a_rows + kk * 16 * 2)
        for nn in range(nt // 2):
            b = ldmatrix_x4(smem, b_tile + b_rows + (nn * 16 * c.sd + kk * 16) * 2)
            mma(acc[2 * nn], a, b[0], b[1])
            mma(acc[2 * nn + 1], a, b[2], b[3])
    return acc


def _keys_by_cols(smem, c, offs, acc, x, b_tile):
    b_trans = offs[2]
    for kk in range(c.bm // 16):
        for nn in range(c.dpad // 16):
            b = ldmatrix_x4(smem, b_tile + b_trans + (kk * 16 * c.sd + nn * 16) * 2, trans=True)
            mma(acc[2 * nn], x[kk], b[0], b[1])
            mma(acc[2 * nn + 1], x[kk], b[2], b[3])


def _dq_chunk(smem, c, offs, ds_tile, k_tile):
    b_trans, a_trans_ds = offs[2], offs[3]
    acc = np.zeros((c.dq_chunk // 8, 4, 32))
    for kk in range(c.bn // 16):
        a = ldmatrix_x4(smem, ds_tile + a_trans_ds + kk * 16 * c.sds * 2, trans=True)
        for nn in range(c.dq_chunk // 16):
            b = ldmatrix_x4(smem, k_tile + b_trans + (kk * 16 * c.sd + nn * 16) * 2, trans=True)
            mma(acc[2 * nn], a, b[0], b[1])
            mma(acc[2 * nn + 1], a, b[2], b[3])
    return acc


def _window_ranges(vp, sq, sk):
    """variants.cuh key_range / row_range of the window in vp (None: no window)."""
    left, right = (int(vp["left"]), int(vp["right"])) if vp is not None else (-1, -1)
    off = sk - sq

    def key_range(r0, r1):
        return (max(0, r0 + off - left) if left >= 0 else 0,
                min(sk, r1 - 1 + off + right + 1) if right >= 0 else sk)

    def row_range(j0, j1):
        return (max(0, j0 - off - right) if right >= 0 else 0,
                min(sq, j1 - 1 - off + left + 1) if left >= 0 else sq)

    def visible(row, key):
        ok = np.ones(np.broadcast(row, key).shape, bool)
        if left >= 0:
            ok &= key >= row + off - left
        if right >= 0:
            ok &= key <= row + off + right
        return ok

    return key_range, row_range, visible


def bwd_mma_kernel(mem, p, grid, c, causal, det, late=False, vp=None, visits=None):
    """Every block of cuflash_bwd_mma, in block-index order (the order the hardware dispatches
    them, which the turn counters rely on: a block waits only for blocks dispatched before it,
    so running them one after another must find every turn ready). `late` (OPT bit
    BWD_OPT_LATE): a tile's turn is handed on after the block's next opening barrier, or at its
    end. (BWD_OPT_LEAN changes how the kernel computes the same addresses and values, not them:
    the model is the same.)"""
    sq, sk, d = int(p["sq"]), int(p["sk"]), int(p["d"])
    diag = sk - sq
    nn_blocks = int(p["n_nblocks"])
    kv_red = int(p["kv_red"])
    n_red = reduce_count(p, kv_red)
    n_mtiles = (sq + c.bm - 1) // c.bm
    scale_log2, scale = float(p["scale_log2"]), float(p["scale"])
    log2e = 1.4426950408889634
    dqa_sr = int(p["dqa_sr"])
    offs = _lane_offsets(c)
    key_range, row_range, win_visible = _window_ranges(vp, sq, sk)
    cap = float(vp["softcap"]) if vp is not None else 0.0
    for bid in range(grid):
        owner, nblock = bid // nn_blocks, nn_blocks - 1 - bid % nn_blocks
        key0 = nblock * c.bn
        first_row = max(key0 - diag, 0) if causal else 0
        m_first = n_mtiles if first_row >= sq else first_row // c.bm
        m_end = n_mtiles
        if vp is not None:  # the window's query tiles for this key block
            r0, r1 = row_range(key0, min(key0 + c.bn, sk))
            if r0 >= r1:
                m_end = m_first
            else:
                m_first = max(m_first, r0 // c.bm)
                m_end = max(m_first, min(n_mtiles, -(-r1 // c.bm)))
        n_iter = n_red * (m_end - m_first)
        smem = np.full(c.half_elems, np.nan)  # unwritten shared memory is NaN
        lse_s = np.full(c.stages * c.bm, np.nan)
        delta_s = np.full(c.stages * c.bm, np.nan)
        off0 = bwd_offsets(p, bwd_index(p, kv_red, owner, 0))
        _load_tile(mem, smem, c.k_off, int(p["k"]), off0["k"], key0, c.bn, sk, int(p["k_sr"]), d,
                   c.sd)
        _load_tile(mem, smem, c.v_off, int(p["v"]), off0["v"], key0, c.bn, sk, int(p["v_sr"]), d,
                   c.sd)

        def load_rows(it):
            red = it // (m_end - m_first)
            i0 = (m_first + it % (m_end - m_first)) * c.bm
            off = bwd_offsets(p, bwd_index(p, kv_red, owner, red))
            buf = it % 2 if c.stages == 2 else 0
            _load_tile(mem, smem, c.q_off + buf * c.bm * c.sd, int(p["q"]), off["q"], i0, c.bm,
                       sq, int(p["q_sr"]), d, c.sd)
            _load_tile(mem, smem, c.do_off + buf * c.bm * c.sd, int(p["dout"]), off["do"], i0,
                       c.bm, sq, int(p["do_sr"]), d, c.sd)
            for r in range(c.bm):
                row = i0 + r
                l2, dl = np.inf, 0.0
                if row < sq:
                    lv = float(mem.read(int(p["lse"]), [off["lse"] + row * int(p["lse_sr"])])[0])
                    if lv != -np.inf:
                        l2 = lv * log2e
                    dl = float(mem.read(int(p["delta"]), [off["delta"] + row])[0])
                lse_s[buf * c.bm + r] = l2
                delta_s[buf * c.bm + r] = dl

        if n_iter > 0:
            load_rows(0)
        dk_acc = np.zeros((c.nwarps, c.nt_d, 4, 32))
        dv_acc = np.zeros((c.nwarps, c.nt_d, 4, 32))
        pending = None  # late: (turn address, value) released after the next barrier
        for it in range(n_iter):
            if pending is not None:
                mem.write(int(p["dq_accum"]), [pending[0]], [pending[1]])
                pending = None
            buf = it % 2 if c.stages == 2 else 0
            red = it // (m_end - m_first)
            i0 = (m_first + it % (m_end - m_first)) * c.bm
            if visits is not None:
                visits.append((bid, i0 // c.bm, red))
            q_t = (c.q_off + buf * c.bm * c.sd) * 2
            do_t = (c.do_off + buf * c.bm * c.sd) * 2
            lse_t = lse_s[buf * c.bm:(buf + 1) * c.bm]
            delta_t = delta_s[buf * c.bm:(buf + 1) * c.bm]
            need_mask = key0 + c.bn > sk or (causal and key0 + c.bn - 1 > i0 + diag)
            for w in range(c.nwarps):
                k_w = (c.k_off + w * 16 * c.sd) * 2
                v_w = (c.v_off + w * 16 * c.sd) * 2
                key_w = key0 + w * 16 + G
                s = _keys_by_rows(smem, c, offs, k_w, q_t, c.nt_q)
                lo = key_w - i0 - diag if (causal and need_mask) else np.full(32, -c.bm)
                real = [key_w < sk, key_w + 8 < sk]
                dsc = np.ones((c.nt_q, 4, 32))
                for nt in range(c.nt_q):
                    for e in range(4):
                        qc = nt * 8 + 2 * T4 + (e % 2)
                        if vp is None:
                            x = np.exp2(s[nt][e] * scale_log2 - lse_t[qc])
                            ok = real[e // 2] & (qc >= lo + 8 * (e // 2))
                        else:  # the policy: scaled score, softcap, visibility by position
                            row, key = i0 + qc, key_w + 8 * (e // 2)
                            t = s[nt][e] * scale
                            if cap:
                                th = np.tanh(t / cap)
                                t, dsc[nt][e] = cap * th, 1.0 - th * th
                            x = np.exp2(t * log2e - lse_t[qc])
                            ok = (key < sk) & win_visible(row, key)
                            if causal:
                                ok &= key <= row + diag
                        s[nt][e] = np.where(ok, x, 0.0)
                pk = pack_p(s)
                _keys_by_cols(smem, c, offs, dv_acc[w], pk, do_t)
                dsk = np.empty((c.bm // 16, 4, 32, 2))
                nh = c.nt_q // 2
                for hf in range(2):
                    dp = _keys_by_rows(smem, c, offs, v_w, do_t + hf * (c.bm // 2) * c.sd * 2, nh)
                    for i in range(nh):
                        nt = hf * nh + i
                        for e in range(4):
                            qc = nt * 8 + 2 * T4 + (e % 2)
                            pv = pk[nt // 2][(nt % 2) * 2 + e // 2][:, e % 2]
                            dp[i][e] = np.where(pv == 0, 0.0,
                                                pv * (dp[i][e] - delta_t[qc]) * dsc[nt][e])
                    dsk[hf * (nh // 2):(hf + 1) * (nh // 2)] = pack_p(dp)
                for kk in range(c.bm // 16):
                    for wd in range(4):
                        row = w * 16 + G + 8 * (wd % 2)
                        col = (2 * kk + wd // 2) * 8 + 2 * T4
                        base = c.ds_off + row * c.sds + col
                        smem[base] = dsk[kk][wd][:, 0]
                        smem[base + 1] = dsk[kk][wd][:, 1]
                _keys_by_cols(smem, c, offs, dk_acc[w], dsk, q_t)
            # (barrier) turn, then dQ
            dqa = int(p["dq_accum"])
            dqa_off = bwd_offsets(p, bwd_index(p, kv_red, owner, red))["dqa"]
            turn_at = dqa_off + i0 * dqa_sr + c.dpad
            n_keys = min(sk, min(i0 + c.bm, sq) - 1 + diag + 1) if causal else sk
            if vp is not None:
                n_keys = min(n_keys, key_range(i0, min(i0 + c.bm, sq))[1])
            my_turn = (n_keys - 1) // c.bn - nblock
            if det:
                got = mem.read(dqa, [turn_at])[0]
                assert got == my_turn, f"block {bid}: turn {got} at tile {i0} != {my_turn}"
            if c.stages == 1 and it + 1 < n_iter:
                load_rows_after = True
            else:
                load_rows_after = False
            for w in range(c.nwarps):
                mq, cg = w % c.mt_q, w // c.mt_q
                row_a = i0 + mq * 16 + G
                for ch in range(c.dq_cols // c.dq_chunk):
                    col0 = cg * c.dq_cols + ch * c.dq_chunk
                    acc = _dq_chunk(smem, c, offs, (c.ds_off + mq * 16) * 2, (c.k_off + col0) * 2)
                    for nt in range(c.dq_chunk // 8):
                        for h in range(2):
                            row = row_a + 8 * h
                            ok = row < sq
                            for j in range(2):
                                at = dqa_off + row[ok] * dqa_sr + col0 + nt * 8 + 2 * T4[ok] + j
                                cur = mem.read(dqa, at)
                                mem.write(dqa, at, cur + acc[nt][2 * h + j][ok])
            if det and late:
                pending = (turn_at, my_turn + 1)
            elif det:
                mem.write(dqa, [turn_at], [my_turn + 1])
            if load_rows_after:
                load_rows(it + 1)
            elif c.stages == 2 and it + 1 < n_iter:
                load_rows(it + 1)
        if pending is not None:
            mem.write(int(p["dq_accum"]), [pending[0]], [pending[1]])
        off = bwd_offsets(p, bwd_index(p, kv_red, owner, 0))
        for w in range(c.nwarps):
            for h in range(2):
                key = key0 + w * 16 + G + 8 * h
                for nt in range(c.nt_d):
                    col = nt * 8 + 2 * T4
                    ok = (key < sk) & (col < d)
                    for j in range(2):
                        mem.write(int(p["dk"]), off["dk"] + key[ok] * int(p["dk_sr"]) + col[ok] + j,
                                  scale * dk_acc[w][nt][2 * h + j][ok])
                        mem.write(int(p["dv"]), off["dv"] + key[ok] * int(p["dv_sr"]) + col[ok] + j,
                                  dv_acc[w][nt][2 * h + j][ok])


def convert_dq(mem, p, grid):
    """cuflash_bwd_convert_dq: dq = scale * dq_accum over the q owners."""
    d = int(p["d"])
    for owner, row in prep_rows(p, grid, BWD_PREP_ROWS):
        off = bwd_offsets(p, bwd_index(p, int(p["q_red"]), owner, 0))
        acc = mem.read(int(p["dq_accum"]), off["dqa"] + row * int(p["dqa_sr"]) + np.arange(d))
        mem.write(int(p["dq"]), off["dq"] + row * int(p["dq_sr"]) + np.arange(d),
                  float(p["scale"]) * acc)


def run_plan_launches(mem, launches, bplan, causal, visits=None):
    """Run the launches recorded from launch_backward for a tensor-core plan (a launch's
    parameters: BwdParams, or (BwdParams, VariantParams) for a variant's kernel)."""
    kern = bplan.passes[0][1]
    name = kern.spec.name
    targs = [x.strip() for x in name[name.index("<") + 1:name.rindex(">")].split(",")]
    dpad, bm, bn, nwarps, stages = (int(x) for x in targs[1:6])
    assert targs[7] == ("true" if causal else "false")
    det = targs[8] == "true"
    opt = int(targs[9])
    assert opt & ~3 == 0, f"no model of OPT bits {opt}"
    c = Cfg(dpad, bm, bn, nwarps, stages)
    assert c.smem_bytes == kern.smem_bytes, "the host's shared-memory size is BwdMmaConfig's"
    for spec_name, grid, threads, params in launches:
        vp = None
        if isinstance(params, tuple):
            params, vp = params if len(params) == 2 else (params[0], None)
        if "cuflash_bwd_preprocess" in spec_name:
            preprocess(mem, params, grid)
        elif "cuflash_bwd_mma" in spec_name:
            assert threads == 32 * nwarps
            assert (vp is not None) == ("cuflash_bwd_mma_var<" in spec_name)
            bwd_mma_kernel(mem, params, grid, c, causal, det, late=bool(opt & 2), vp=vp,
                           visits=visits)
        elif "cuflash_bwd_convert_dq" in spec_name:
            convert_dq(mem, params, grid)
        else:
            raise AssertionError(f"no model of {spec_name}")
