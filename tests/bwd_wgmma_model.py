"""A thread-level NumPy model of the Hopper backward kernel (kernels_cu/attn_bwd_wgmma.cu:
cuflash_bwd_wgmma), run on the parameter block that cuflash._launch.launch_backward builds
(memory, batch helpers, the preprocess and the dq conversion come from tests/bwd_generic_model.py
and tests/bwd_mma_model.py).

What it models, written from the PTX ISA independently of the kernel: the 128-byte swizzle
(16-byte chunk bits 4-6 of a shared-memory address XOR bits 7-9), the wgmma matrix descriptor
(start address, leading and stride byte offsets, in 16-byte units) and how wgmma reads a
K-major operand (8-row groups SBO apart, 128-byte rows, K along the row) and an MN-major one
(transposed: 8-row groups of K SBO apart, 64 M/N elements per 128-byte row, the next 64 LBO
apart), the m64nN accumulator fragment (warp w of the warpgroup rows 16 w + g (+8), columns
8 nt + 2 t4 (+1)), the m16n8k16-style A fragment of wgmma with A in registers, and quad_transpose
(common.cuh). What it transcribes from the kernel: the shared-memory layout, every thread's
cp.async addresses (load_swizzled), the descriptor arithmetic of each of the five products, the
dS^T stores, the dQ pieces and their atomics, masks, tails, block skipping, the batch loops, the
turn counters (checked to be ready when each block, run in block-index order, gets there) and the
16-byte dk / dv stores. Arithmetic is float64 without 16-bit rounding, so a layout mistake shows
up as a gradient far above the tolerance, and shared memory starts as NaN, so reading anything
that was not written poisons the result.

With a variant's VariantParams (cuflash_bwd_wgmma_var; window and softcap: the positional part
and the transform with a derivative) it also models the window's query tiles per key block
(row_range), the turns over the visited key blocks (key_range), the per-element visibility,
softcap's d score / d t on dS (float64 tanh: the model checks structure, not the fast form's
roundings) and the variant kernel's factored dS store addresses; `visits` collects (block
index, query tile, reduction step). d score / d t's shared-memory round trip is per thread
(each thread reads back its own words) and not modelled.
"""
import numpy as np

from bwd_generic_model import bwd_index, bwd_offsets, preprocess, reduce_count
from bwd_mma_model import _window_ranges, convert_dq

LOG2E = 1.4426950408889634


# ---- PTX semantics -------------------------------------------------------------------------

def swizzle128(addr):
    """The 128-byte swizzle: the 16-byte chunk index (bits 4-6) XOR the 128-byte row index within
    the 1024-byte atom (bits 7-9)."""
    addr = np.asarray(addr, dtype=np.int64)
    return addr ^ (((addr >> 7) & 7) << 4)


def desc_fields(desc):
    """(start address, LBO, SBO) in bytes of a wgmma matrix descriptor with the 128-byte swizzle."""
    desc = int(desc)
    assert desc >> 62 == 1, "swizzle mode 1 (128 bytes)"
    return (desc & 0x3FFF) << 4, ((desc >> 16) & 0x3FFF) << 4, ((desc >> 32) & 0x3FFF) << 4


def read_k_major(smem, desc, rows):
    """A K-major operand of k16 (rows x 16 16-bit elements): row r, element k at start +
    (r / 8) SBO + (r % 8) * 128 + 2 k, swizzled."""
    start, _, sbo = desc_fields(desc)
    r = np.arange(rows)[:, None]
    k = np.arange(16)[None, :]
    return smem[swizzle128(start + (r // 8) * sbo + (r % 8) * 128 + 2 * k) // 2]


def read_mn_major(smem, desc, n):
    """An MN-major (transposed) operand of k16, returned as (n x 16): element (x, k) at start +
    (x / 64) LBO + (k / 8) SBO + (k % 8) * 128 + 2 (x % 64), swizzled."""
    start, lbo, sbo = desc_fields(desc)
    x = np.arange(n)[:, None]
    k = np.arange(16)[None, :]
    return smem[swizzle128(start + (x // 64) * lbo + (k // 8) * sbo + (k % 8) * 128
                           + 2 * (x % 64)) // 2]


WG = np.arange(128)
WARP, LANE = WG // 32, WG % 32
G, T4 = LANE // 4, LANE % 4


def acc_coords(n):
    """(row, column) of accumulator register i = 4 nt + e of every thread of a warpgroup, for
    m64nN: (128, N / 2) each."""
    i = np.arange(n // 2)[None, :]
    nt, e = i // 4, i % 4
    return 16 * WARP[:, None] + G[:, None] + 8 * (e // 2), 8 * nt + 2 * T4[:, None] + e % 2


def to_frag(mat):
    r, c = acc_coords(mat.shape[1])
    return mat[r, c]


def from_frag(frag, n):
    r, c = acc_coords(n)
    mat = np.full((64, n), np.nan)
    mat[r, c] = frag
    return mat


def a_from_regs(regs):
    """The 64 x 16 A operand of a wgmma with A in registers: regs (128, 4, 2) (register j of each
    thread, low half first): warp w rows 16 w + g (j odd: + 8), columns 2 t4 (+1) (j >= 2: + 8)."""
    a = np.full((64, 16), np.nan)
    for j in range(4):
        for h in range(2):
            a[16 * WARP + G + 8 * (j % 2), 2 * T4 + 8 * (j // 2) + h] = regs[:, j, h]
    return a


def quad_transpose(w):
    """common.cuh quad_transpose on words w (4, 32 lanes, 2 halves), lane t4 = lane % 4."""
    w = w.copy()
    lane = np.arange(32)
    t4 = lane % 4
    hi, odd = (t4 & 2) != 0, (t4 & 1) != 0
    for k in range(2):
        send = np.where(hi[:, None], w[k], w[k + 2])
        got = send[lane ^ 2]
        w[k] = np.where(hi[:, None], got, w[k])
        w[k + 2] = np.where(hi[:, None], w[k + 2], got)
    for k in (0, 2):
        send = np.where(odd[:, None], w[k], w[k + 1])
        got = send[lane ^ 1]
        w[k] = np.where(odd[:, None], got, w[k])
        w[k + 1] = np.where(odd[:, None], w[k + 1], got)
    return w


# ---- the kernel ----------------------------------------------------------------------------

def wgmma_desc(addr, lbo, sbo):
    """common.cuh wgmma_desc."""
    return ((addr & 0x3FFFF) >> 4) | ((lbo >> 4) << 16) | ((sbo >> 4) << 32) | (1 << 62)


class Cfg:
    """BwdWgmmaConfig."""

    def __init__(self, dpad, bm, bn, ds_kmajor=True):
        self.dpad, self.bm, self.bn, self.ds_kmajor = dpad, bm, bn, ds_kmajor
        # SPLIT (D > 128): two warpgroups share the block's 64 keys; warpgroup c has queries
        # sn c .. of S^T / dP^T and dK, dV columns dkv_n c ..
        self.split = dpad > 128
        self.consumers = 2 if self.split else bn // 64
        self.threads = 128 * self.consumers
        self.sn = bm // self.consumers if self.split else bm
        self.dkv_n = dpad // self.consumers if self.split else dpad
        self.panels = dpad // 64
        self.kv_panel, self.q_panel = bn * 128, bm * 128
        self.kv_bytes, self.q_bytes = self.panels * self.kv_panel, self.panels * self.q_panel
        self.ds_panel = bm * 128 if ds_kmajor else bn * 128
        self.ds_bytes = bm * bn * 2
        self.k_off, self.v_off = 0, self.kv_bytes
        self.q_off = 2 * self.kv_bytes
        self.do_off = self.q_off + 2 * self.q_bytes
        self.ds_off = self.do_off + 2 * self.q_bytes
        self.pt_panel = bn * 128
        self.pt_off = self.ds_off + self.ds_bytes
        self.dst_off = (self.pt_off + self.ds_bytes * self.split) if ds_kmajor else self.ds_off
        self.ld_off = self.ds_off + self.ds_bytes * (1 + self.split + (self.split and ds_kmajor))
        self.turn_off = self.ld_off + 2 * 2 * bm * 4  # (DET) thread 0's pending hand-over
        self.smem = 1024 + self.turn_off + 16
        self.pieces = (bm // 64) * self.panels
        self.pieces_wg = self.pieces // self.consumers
        assert self.pieces % self.consumers == 0
        self.dp_early = bm == 64


def load_swizzled(mem, smem, dst, ptr, base, ld, row0, rows, n_rows, d, c):
    """load_swizzled: every thread's 16-byte copies (zero-filled past n_rows and d)."""
    chunks = c.dpad // 8
    rstep = c.threads // chunks
    tid = np.arange(c.threads)
    r0, ch = tid // chunks, tid % chunks
    d0 = dst + (ch // 8) * (rows * 128) + r0 * 128 + (((ch % 8) ^ (r0 % 8)) << 4)
    for n in range(rows // rstep):
        row = row0 + r0 + n * rstep
        ok = (ch * 8 < d) & (row < n_rows)
        for e in range(8):
            vals = np.zeros(c.threads)
            if ok.any():
                vals[ok] = mem.read(ptr, base + row[ok] * ld + ch[ok] * 8 + e)
            smem[(d0 + n * rstep * 128) // 2 + e] = vals


def block_order(bid, grid, nn, det, nsm):
    """common.cuh bwd_key_block: (k/v owner, rank) of block index bid; DET_ORDER (det): groups
    of W = max(1, nsm / nn) owners, rank-major inside a group."""
    if not det:
        return divmod(bid, nn)
    owners, w = grid // nn, max(1, nsm // nn)
    group, rest = divmod(bid, w * nn)
    wg = min(w, owners - group * w)
    rank, o = divmod(rest, wg)
    return group * w + o, rank


def key_blocks(p, grid, bm, bn, causal, det=False, nsm=132, vp=None):
    """common.cuh bwd_key_block for every block index, in order: (block index, k/v owner, key
    block, the (reduction step, query tile) visits); with a window (vp) the query tiles that
    hold a row seeing one of the block's keys by position (attn_bwd_wgmma.cu: row_range)."""
    sq, sk, nn = int(p["sq"]), int(p["sk"]), int(p["n_nblocks"])
    steps = range(reduce_count(p, int(p["kv_red"])))
    n_mtiles = -(-sq // bm)
    _, row_range, _ = _window_ranges(vp, sq, sk)
    for bid in range(grid):
        owner, rev = block_order(bid, grid, nn, det, nsm)
        nblock = nn - 1 - rev
        first = max(nblock * bn - (sk - sq), 0) if causal else 0
        m_first = n_mtiles if first >= sq else first // bm
        m_end = n_mtiles
        if vp is not None and (int(vp["left"]) >= 0 or int(vp["right"]) >= 0):
            r0, r1 = row_range(nblock * bn, min(nblock * bn + bn, sk))
            if r0 >= r1:
                m_end = m_first
            else:
                m_first = max(m_first, r0 // bm)
                m_end = max(m_first, min(n_mtiles, -(-r1 // bm)))
        yield bid, owner, nblock, [(r, mt) for r in steps for mt in range(m_first, m_end)]


def bwd_wgmma_kernel(mem, p, grid, c, causal, det, nsm=132, vp=None, visits=None):
    """Every block of cuflash_bwd_wgmma in block-index order (the dispatch order the turns rely
    on), each warpgroup's products as matrices read through the descriptors the kernel builds.
    nsm: what %nsmid reads (the deterministic block order and start gate depend on it, the
    results must not)."""
    sq, sk, d = int(p["sq"]), int(p["sk"]), int(p["d"])
    kv_red, diag = int(p["kv_red"]), sk - sq
    scale_log2, scale = float(p["scale_log2"]), float(p["scale"])
    dqa_sr, dqa = int(p["dqa_sr"]), int(p["dq_accum"])
    bm, bn, dpad = c.bm, c.bn, c.dpad
    # the kernel's RED4: 16-byte dq reductions in the plain kernel but at D = 64 causal (registers)
    red4 = vp is None and not (dpad == 64 and causal)
    seen = set()
    key_range, _, win_visible = _window_ranges(vp, sq, sk)
    window = vp is not None and (int(vp["left"]) >= 0 or int(vp["right"]) >= 0)
    cap = float(vp["softcap"]) if vp is not None else 0.0
    seen_visits = visits
    for bid, owner, nblock, visits in key_blocks(p, grid, bm, bn, causal, det, nsm, vp):
        if seen_visits is not None:
            seen_visits.extend((bid, mt, red) for red, mt in visits)
        assert (owner, nblock) not in seen, "every (owner, key block) once"
        seen.add((owner, nblock))
        key0, n_iter = nblock * bn, len(visits)
        smem = np.full(c.smem // 2, np.nan)   # 16-bit elements, by byte address / 2
        fsm = np.full(c.smem // 4, np.nan)    # float32 words, by byte address / 4
        off0 = bwd_offsets(p, bwd_index(p, kv_red, owner, 0))
        load_swizzled(mem, smem, c.k_off, int(p["k"]), off0["k"], int(p["k_sr"]), key0, bn, sk,
                      d, c)
        load_swizzled(mem, smem, c.v_off, int(p["v"]), off0["v"], int(p["v_sr"]), key0, bn, sk,
                      d, c)
        lse_s, delta_s = c.ld_off, c.ld_off + 2 * bm * 4

        def load_rows(red, i0, buf):
            off = bwd_offsets(p, bwd_index(p, kv_red, owner, red))
            load_swizzled(mem, smem, c.q_off + buf * c.q_bytes, int(p["q"]), off["q"],
                          int(p["q_sr"]), i0, bm, sq, d, c)
            load_swizzled(mem, smem, c.do_off + buf * c.q_bytes, int(p["dout"]), off["do"],
                          int(p["do_sr"]), i0, bm, sq, d, c)
            l2, dl = np.full(bm, np.inf), np.zeros(bm)
            for r in range(bm):
                row = i0 + r
                if row < sq:
                    lv = float(mem.read(int(p["lse"]), [off["lse"] + row * int(p["lse_sr"])])[0])
                    if lv != -np.inf:
                        l2[r] = lv * LOG2E
                    dl[r] = float(mem.read(int(p["delta"]), [off["delta"] + row])[0])
            return l2, dl  # registers of threads tid < BM

        if n_iter:
            l2, dl = load_rows(visits[0][0], visits[0][1] * bm, 0)
            fsm[lse_s // 4 + np.arange(bm)] = l2
            fsm[delta_s // 4 + np.arange(bm)] = dl
        dk_acc = np.zeros((c.consumers, 128, c.dkv_n // 2))
        dv_acc = np.zeros((c.consumers, 128, c.dkv_n // 2))
        if det and not causal and not window and n_iter > 1 and grid >= 8 * nsm:  # the gate
            at0 = bwd_offsets(p, bwd_index(p, kv_red, owner, visits[0][0]))["dqa"] + dpad
            got = mem.read(dqa, [at0])[0]
            rank = int(p["n_nblocks"]) - 1 - nblock
            assert got == rank, f"block {bid}: gate turn {got} != {rank}"
        for it, (red, mt) in enumerate(visits):
            buf, i0 = it & 1, mt * bm
            if it + 1 < n_iter:
                l2n, dln = load_rows(visits[it + 1][0], visits[it + 1][1] * bm, 1 - buf)
            q_t, do_t = c.q_off + buf * c.q_bytes, c.do_off + buf * c.q_bytes
            lse_t, delta_t = lse_s + buf * bm * 4, delta_s + buf * bm * 4
            pks, dsks = [], []
            sn = c.sn
            for cw in range(c.consumers):
                kwo = 0 if c.split else 64 * cw
                q0 = sn * cw if c.split else 0
                kw0 = key0 + kwo
                key_t = kw0 + 16 * WARP + G

                def keys_by_queries(kv, rows):
                    acc = np.zeros((64, sn))
                    for kk in range(dpad // 16):
                        da = wgmma_desc(kv + kwo * 128 + (kk // 4) * c.kv_panel
                                        + (kk % 4) * 32, 16, 1024)
                        db = wgmma_desc(rows + q0 * 128 + (kk // 4) * c.q_panel + (kk % 4) * 32,
                                        16, 1024)
                        acc += read_k_major(smem, da, 64) @ read_k_major(smem, db, sn).T
                    return to_frag(acc)

                s = keys_by_queries(c.k_off, q_t)
                dp = keys_by_queries(c.v_off, do_t)
                need_mask = kw0 + 64 > sk or (causal and kw0 + 63 > i0 + q0 + diag)
                lo = key_t - i0 - diag - q0 if causal else np.full(128, -bm)
                real = [key_t < sk, key_t + 8 < sk]
                dsc = np.ones((128, sn // 2))
                for nt in range(sn // 8):
                    lpair = fsm[(lse_t + (q0 + nt * 8 + 2 * T4) * 4) // 4
                                + np.arange(2)[:, None]]
                    for e in range(4):
                        if vp is None:
                            x = np.exp2(s[:, 4 * nt + e] * scale_log2 - lpair[e % 2])
                            if need_mask:
                                qc = nt * 8 + 2 * T4 + (e % 2)
                                ok = real[e // 2] & (qc >= lo + 8 * (e // 2))
                                x = np.where(ok, x, 0.0)
                        else:  # the policy: scaled score, softcap, visibility by position
                            row = i0 + q0 + nt * 8 + 2 * T4 + (e % 2)
                            key = key_t + 8 * (e // 2)
                            t = s[:, 4 * nt + e] * scale
                            if cap:
                                th = np.tanh(t / cap)
                                t, dsc[:, 4 * nt + e] = cap * th, 1.0 - th * th
                            x = np.exp2(t * LOG2E - lpair[e % 2])
                            ok = (key < sk) & win_visible(row, key)
                            if causal:
                                ok &= key <= row + diag
                            x = np.where(ok, x, 0.0)
                        s[:, 4 * nt + e] = x
                pk = _pack_p(s, sn)
                for nt in range(sn // 8):
                    dpair = fsm[(delta_t + (q0 + nt * 8 + 2 * T4) * 4) // 4
                                + np.arange(2)[:, None]]
                    for e in range(4):
                        pv = pk[:, nt // 2, (nt % 2) * 2 + e // 2, e % 2]
                        dp[:, 4 * nt + e] = np.where(
                            pv == 0, 0.0, pv * (dp[:, 4 * nt + e] - dpair[e % 2])
                            * dsc[:, 4 * nt + e])
                dsk = _pack_p(dp, sn)

                def store_keys_by_queries(at, row, col, word):  # one 32-bit word (key, query)
                    addr = (at + (col // 64) * c.pt_panel + row * 128
                            + ((((col % 64) // 8) ^ (row % 8)) << 4) + (col % 8) * 2)
                    smem[addr // 2] = word[:, 0]
                    smem[addr // 2 + 1] = word[:, 1]

                for kk in range(sn // 16):
                    for w in range(4):
                        row = kwo + 16 * WARP + G + 8 * (w % 2)
                        col = q0 + (2 * kk + w // 2) * 8 + 2 * T4
                        if c.split:  # P^T and (K-major dS) dS^T [key][query] for dV, dK
                            store_keys_by_queries(c.pt_off, row, col, pk[:, kk, w])
                            if c.ds_kmajor:
                                store_keys_by_queries(c.dst_off, row, col, dsk[:, kk, w])
                        for h in range(2):
                            if c.ds_kmajor and vp is not None and not c.split:
                                # the variant kernel's factored form (ds_at): four bases of
                                # (w % 2, h) and the immediates of (kk, w / 2)
                                b0 = c.ds_off + (kwo // 64) * c.ds_panel + (q0 + 2 * T4) * 128 \
                                    + G * 2
                                addr = (b0 + h * 128 + (((2 * WARP + w % 2) ^ (2 * T4 + h)) << 4)
                                        + (2 * kk + w // 2) * 1024)
                                smem[addr // 2] = dsk[:, kk, w, h]
                            elif c.ds_kmajor:  # dS: (query, key), 64-key panels
                                cq = col + h
                                addr = (c.ds_off + (row // 64) * c.ds_panel + cq * 128
                                        + ((((row % 64) // 8) ^ (cq % 8)) << 4) + (row % 8) * 2)
                                smem[addr // 2] = dsk[:, kk, w, h]
                            else:  # dS^T: (key, query), 64-query panels, one 32-bit word
                                addr = (c.ds_off + (col // 64) * c.ds_panel + row * 128
                                        + ((((col % 64) // 8) ^ (row % 8)) << 4) + (col % 8) * 2)
                                smem[addr // 2 + h] = dsk[:, kk, w, h]
                pks.append(pk)
                dsks.append(dsk)
            # dV, dK: after the stores (they read registers only; SPLIT: P^T and dS^T from
            # shared memory, after barrier 2, columns c0 .. of dO and Q)
            for cw in range(c.consumers):
                nkv = c.dkv_n
                c0 = nkv * cw if c.split else 0
                dv = from_frag(dv_acc[cw], nkv)
                dk = from_frag(dk_acc[cw], nkv)
                for kk in range(bm // 16):
                    b = (c0 // 64) * c.q_panel + kk * 16 * 128
                    bdo = read_mn_major(smem, wgmma_desc(do_t + b, c.q_panel, 1024), nkv)
                    bq = read_mn_major(smem, wgmma_desc(q_t + b, c.q_panel, 1024), nkv)
                    if c.split:
                        a = (kk // 4) * c.pt_panel + (kk % 4) * 32
                        ap = read_k_major(smem, wgmma_desc(c.pt_off + a, 16, 1024), 64)
                        ads = read_k_major(smem, wgmma_desc(c.dst_off + a, 16, 1024), 64)
                    else:
                        ap, ads = a_from_regs(pks[cw][:, kk]), a_from_regs(dsks[cw][:, kk])
                    dv += ap @ bdo.T
                    dk += ads @ bq.T
                dv_acc[cw], dk_acc[cw] = to_frag(dv), to_frag(dk)
            if it + 1 < n_iter:  # the next tile's lse2 / delta, into the other buffer
                fsm[(lse_s + (1 - buf) * bm * 4) // 4 + np.arange(bm)] = l2n
                fsm[(delta_s + (1 - buf) * bm * 4) // 4 + np.arange(bm)] = dln
            dqa_off = bwd_offsets(p, bwd_index(p, kv_red, owner, red))["dqa"]
            turn_at = dqa_off + i0 * dqa_sr + dpad
            n_keys = min(sk, min(i0 + bm, sq) - 1 + diag + 1) if causal else sk
            if window:   # the keys the tile's rows see by position
                n_keys = min(n_keys, key_range(i0, min(i0 + bm, sq))[1])
            my_turn = (n_keys - 1) // bn - nblock
            if det:
                got = mem.read(dqa, [turn_at])[0]
                assert got == my_turn, f"block {bid}: turn {got} at tile {i0} != {my_turn}"
            # (barrier 2) dQ pieces
            for cw in range(c.consumers):
                for pc in range(c.pieces_wg):
                    piece = cw * c.pieces_wg + pc
                    mp, np_ = piece // c.panels, piece % c.panels
                    acc = np.zeros((64, 64))
                    for kk in range(bn // 16):
                        db = wgmma_desc(c.k_off + np_ * c.kv_panel + kk * 16 * 128, c.kv_panel,
                                        1024)
                        if c.ds_kmajor:
                            da = wgmma_desc(c.ds_off + (kk // 4) * c.ds_panel + 64 * mp * 128
                                            + (kk % 4) * 32, 16, 1024)
                            a = read_k_major(smem, da, 64)
                        else:
                            da = wgmma_desc(c.ds_off + mp * c.ds_panel + kk * 16 * 128,
                                            c.ds_panel, 1024)
                            a = read_mn_major(smem, da, 64)
                        acc += a @ read_mn_major(smem, db, 64).T
                    frag = to_frag(acc)
                    if not red4:  # 8-byte reductions: each pair where it is
                        for h in range(2):
                            row = i0 + 64 * mp + 16 * WARP + G + 8 * h
                            ok = row < sq
                            for nt in range(8):
                                for j in range(2):
                                    at = (dqa_off + row[ok] * dqa_sr + 64 * np_ + 2 * T4[ok]
                                          + nt * 8 + j)
                                    cur = mem.read(dqa, at)
                                    mem.write(dqa, at, cur + frag[ok, nt * 4 + 2 * h + j])
                        continue
                    # RED4, the kernel's 16-byte reductions: lanes t4 and t4 ^ 1 swap one pair of
                    # each two 8-column blocks (2 j, 2 j + 1); the even lane adds its block
                    # 2 j pair and its partner's at column 16 j + 4 (t4 >> 1), the odd lane its
                    # partner's block 2 j + 1 pair and its own at 16 j + 8 + 4 (t4 >> 1).
                    odd = (T4 & 1) == 1
                    partner = WG ^ 1
                    col4 = 64 * np_ + np.where(odd, 8, 0) + 4 * (T4 >> 1)
                    for h in range(2):
                        row = i0 + 64 * mp + 16 * WARP + G + 8 * h
                        ok = row < sq
                        for j in range(4):
                            a = frag[:, [8 * j + 2 * h, 8 * j + 2 * h + 1]]
                            b = frag[:, [8 * j + 4 + 2 * h, 8 * j + 5 + 2 * h]]
                            r = np.where(odd[:, None], a, b)[partner]  # what the partner sent
                            v = np.where(odd[:, None], np.concatenate([r, b], 1),
                                         np.concatenate([a, r], 1))
                            for e in range(4):
                                at = dqa_off + row[ok] * dqa_sr + col4[ok] + 16 * j + e
                                cur = mem.read(dqa, at)
                                mem.write(dqa, at, cur + v[ok, e])
            if det:
                mem.write(dqa, [turn_at], [my_turn + 1])
        off = bwd_offsets(p, bwd_index(p, kv_red, owner, 0))
        for cw in range(c.consumers):
            key_t = key0 + (0 if c.split else 64 * cw) + 16 * WARP + G
            c0 = c.dkv_n * cw if c.split else 0
            for name, acc, mul in (("dk", dk_acc[cw], scale), ("dv", dv_acc[cw], 1.0)):
                for h in range(2):
                    key = key_t + 8 * h
                    for cc in range(c.dkv_n // 32):
                        for wp in range(4):  # one warp at a time: quad_transpose is per warp
                            sel = WARP == wp
                            words = np.stack([np.stack(
                                [mul * acc[sel, (4 * cc + j) * 4 + 2 * h],
                                 mul * acc[sel, (4 * cc + j) * 4 + 2 * h + 1]], -1)
                                for j in range(4)])
                            words = quad_transpose(words)
                            col = c0 + (4 * cc + T4[sel]) * 8
                            ok = (key[sel] < sk) & (col < d)
                            for j in range(4):
                                for hh in range(2):
                                    at = (off[name] + key[sel][ok] * int(p[f"{name}_sr"])
                                          + col[ok] + 2 * j + hh)
                                    mem.write(int(p[name]), at, words[j][ok, hh])


def _pack_p(frag, bm):
    """common.cuh pack_p on a warpgroup's accumulators (128, BM / 2) -> (128, BM / 16, 4, 2)."""
    out = np.empty((128, bm // 16, 4, 2))
    for kk in range(bm // 16):
        for w in range(4):
            nt = 2 * kk + w // 2
            out[:, kk, w, 0] = frag[:, 4 * nt + 2 * (w % 2)]
            out[:, kk, w, 1] = frag[:, 4 * nt + 2 * (w % 2) + 1]
    return out


def run_plan_launches(mem, launches, bplan, causal, nsm=132, visits=None):
    """Run the launches recorded from launch_backward for a Hopper plan (nsm: the SM count the
    kernel reads, %nsmid; a launch's parameters: BwdParams, or (BwdParams, VariantParams) for
    a variant's kernel, whose policy may have a window and softcap only)."""
    kern = bplan.passes[0][1]
    name = kern.spec.name
    targs = [x.strip() for x in name[name.index("<") + 1:name.rindex(">")].split(",")]
    dpad, bm, bn = (int(x) for x in targs[1:4])
    assert targs[4] == ("true" if causal else "false")
    det = targs[5] == "true"
    var = "cuflash_bwd_wgmma_var<" in name
    assert var or targs[7] == "cuflash::PlainVariant"
    softcap = False
    if var:   # Variant<WINDOW, SOFTCAP, ALIBI, BiasT, MASK[, FORM]>: the model's parts only
        pol = targs[7:]
        assert pol[0].startswith("cuflash::Variant<") and pol[2] == "false" and \
            pol[3] == "cuflash::NoBias" and pol[4].rstrip(">") == "false", pol
        softcap = pol[1] == "true"
        targs = targs[:7] + ["cuflash::PlainVariant"]
    # targs[8] (OV, the SPLIT form's overlapped schedule): the same products in another order,
    # which this model (one product after another) does not see; tests/bwd_wgmma_schedule.py
    # checks the order.
    assert len(targs) == 8 or (targs[8] in ("true", "false") and dpad > 128)
    c = Cfg(dpad, bm, bn, targs[6] == "true")
    extra = 0
    if softcap and dpad <= 128:   # softcap's d score / d t (DSC_SMEM): BM / 2 floats a thread
        extra = c.threads * bm * 2
    assert c.smem + extra == kern.smem_bytes, "the host's shared-memory size is the kernel's"
    for spec_name, grid, threads, params in launches:
        vp = None
        if isinstance(params, tuple):
            params, vp = params if len(params) == 2 else (params[0], None)
        if "cuflash_bwd_preprocess" in spec_name:
            preprocess(mem, params, grid)
        elif "cuflash_bwd_wgmma" in spec_name:
            assert threads == c.threads == kern.threads
            assert (vp is not None) == ("cuflash_bwd_wgmma_var<" in spec_name)
            bwd_wgmma_kernel(mem, params, grid, c, causal, det, nsm, vp=vp, visits=visits)
        elif "cuflash_bwd_convert_dq" in spec_name:
            convert_dq(mem, params, grid)
        else:
            raise AssertionError(f"no model of {spec_name}")
