"""An index-level NumPy model of the generic backward kernels (kernels_cu/attn_bwd_prep.cu:
cuflash_bwd_preprocess; kernels_cu/attn_bwd_generic.cu: cuflash_bwd_dq_generic and
cuflash_bwd_dkdv_generic), run on the parameter block that cuflash._launch.launch_backward builds.

It transcribes each kernel's block-index decoding, batch-entry loops (bwd_index, bwd_offsets),
tile bounds, causal limits, masks and stores, with the 32 lanes of a warp as a vector and the
arithmetic in float64, over a flat byte-addressed memory holding the tensors at the addresses and
strides the host put in the parameter block. A wrong stride, grid, reduction mask, workspace
offset or tile bound on either side shows up as a wrong (or unwritten, NaN) gradient without a
GPU. Rounding is not modelled (float64 throughout, outputs rounded once to the dtype).
"""
import numpy as np

from cuflash import reference as ref
from cuflash._dispatch import bwd_generic_config, head_dim_bucket


class Memory:
    """Regions (base address, flat float64 values, bytes per element)."""

    def __init__(self):
        self.regions = []
        self.next = 1 << 20

    def alloc(self, n_elems, itemsize, fill=np.nan):
        base = self.next
        self.next += ((n_elems * itemsize + 4095) // 4096 + 1) * 4096
        self.regions.append((base, np.full(n_elems, fill, dtype=np.float64), itemsize))
        return base

    def _find(self, ptr):
        for base, arr, item in self.regions:
            if base <= ptr < base + arr.size * item:
                return base, arr, item
        raise IndexError(f"address {ptr:#x} is in no allocation")

    def index(self, ptr, offsets):
        base, arr, item = self._find(ptr)
        assert (ptr - base) % item == 0
        idx = (ptr - base) // item + np.asarray(offsets, dtype=np.int64)
        if np.any(idx < 0) or np.any(idx >= arr.size):
            raise IndexError(f"access out of bounds of the allocation at {base:#x}: "
                             f"{idx.min()}..{idx.max()} of {arr.size}")
        return arr, idx

    def read(self, ptr, offsets):
        arr, idx = self.index(ptr, offsets)
        return arr[idx]

    def write(self, ptr, offsets, values):
        arr, idx = self.index(ptr, offsets)
        arr[idx] = values


class FakeArray:
    """A strided view in Memory: what launch_backward reads (shape, strides, itemsize, ptr)."""

    def __init__(self, mem, values, itemsize, elem_strides=None, span=None):
        values = np.asarray(values, dtype=np.float64)
        self.shape, self.itemsize, self.ndim = values.shape, itemsize, values.ndim
        if elem_strides is None:
            elem_strides = [int(np.prod(values.shape[i + 1:])) for i in range(values.ndim)]
        self.elem_strides = list(elem_strides)
        self.strides = tuple(s * itemsize for s in elem_strides)
        n = span or (1 + sum((n - 1) * s for n, s in zip(values.shape, elem_strides)))
        self.mem = mem
        ptr = mem.alloc(n, itemsize)
        self.data = type("D", (), {"ptr": ptr})()
        self.nbytes = n * itemsize
        if values.size:
            idx = np.zeros(values.shape, dtype=np.int64)
            for ax, s in enumerate(elem_strides):
                shp = [1] * values.ndim
                shp[ax] = values.shape[ax]
                idx = idx + s * np.arange(values.shape[ax]).reshape(shp)
            mem.write(ptr, idx.reshape(-1), values.reshape(-1))

    def values(self):
        idx = np.zeros(self.shape, dtype=np.int64)
        for ax, s in enumerate(self.elem_strides):
            shp = [1] * self.ndim
            shp[ax] = self.shape[ax]
            idx = idx + s * np.arange(self.shape[ax]).reshape(shp)
        return self.mem.read(self.data.ptr, idx.reshape(-1)).reshape(self.shape)


# ---- common.cuh: batch helpers ------------------------------------------------------------

def _sizes(p):
    return [int(p["nb0"]), int(p["nb1"]), int(p["nb2"])]


def reduce_count(p, red):
    n = 1
    for a, s in enumerate(_sizes(p)):
        n *= s if (red >> a) & 1 else 1
    return n


def bwd_index(p, red, owner, r):
    c = [0, 0, 0]
    sizes = _sizes(p)
    for a in (2, 1, 0):
        n = sizes[a]
        if (red >> a) & 1:
            c[a] = r % n
            r //= n
        else:
            c[a] = owner % n
            owner //= n
    return c


def bwd_offsets(p, c):
    def off(name):
        return sum(c[a] * int(p[f"{name}_s{a}"]) for a in range(3))

    sizes = _sizes(p)
    flat = (c[0] * sizes[1] + c[1]) * sizes[2] + c[2]
    o = {n: off(n) for n in ("q", "k", "v", "o", "do", "dq", "dk", "dv", "lse", "dqa")}
    o["delta"] = flat * int(p["sq"])
    return o


def causal_keys_visible(i, sq, sk):
    return min(i + (sk - sq) + 1, sk)


# ---- the kernels ---------------------------------------------------------------------------

def _tile(mem, ptr, base, first, rows, n_rows, row_stride, cols, stride):
    """bwd_load_tile: rows x stride, zero beyond n_rows and cols."""
    out = np.zeros((rows, stride))
    for r in range(rows):
        row = first + r
        if row < n_rows and cols:
            out[r, :cols] = mem.read(ptr, base + row * row_stride + np.arange(cols))
    return out


def prep_rows(p, grid, rows_per_block=8):
    """(batch or owner index, row) of every warp of the row-per-warp kernels
    (cuflash_bwd_preprocess, cuflash_bwd_convert_dq) that has a row below Sq."""
    sq = int(p["sq"])
    nblk = (sq + rows_per_block - 1) // rows_per_block
    for bid in range(grid):
        for w in range(rows_per_block):
            row = (bid % nblk) * rows_per_block + w
            if row < sq:
                yield bid // nblk, row


def preprocess(mem, p, grid, rows_per_block=8):
    dv = int(p["dv_dim"])
    for b, row in prep_rows(p, grid, rows_per_block):
        c = bwd_index(p, 0, b, 0)
        off = bwd_offsets(p, c)
        cols = np.arange(dv)
        o = mem.read(int(p["o"]), off["o"] + row * int(p["o_sr"]) + cols)
        do = mem.read(int(p["dout"]), off["do"] + row * int(p["do_sr"]) + cols)
        mem.write(int(p["delta"]), [off["delta"] + row], [np.dot(o, do)])
        if int(p["dq_accum"]):
            red = int(p["q_red"])
            if all(not ((red >> a) & 1) or c[a] == 0 for a in range(3)):
                # the whole row: the padding holds turn counters (attn_bwd_mma.cu)
                n = int(p["dqa_sr"])
                mem.write(int(p["dq_accum"]), off["dqa"] + row * n + np.arange(n), np.zeros(n))


def _rows_stats(p):
    return int(p["nb0"]) * int(p["nb1"]) * int(p["nb2"]) * int(p["sq"])


def dq_pass(mem, p, grid, block, causal, dtype, bc=32):
    sq, sk, d, dv = (int(p[n]) for n in ("sq", "sk", "d", "dv_dim"))
    db = dvb = head_dim_bucket(max(d, dv))
    scale = float(p["scale"])
    nm = int(p["n_mblocks"])
    red_mask = int(p["q_red"])
    for bid in range(grid):
        owner = bid // nm
        row0 = (nm - 1 - bid % nm) * block
        n_red = reduce_count(p, red_mask)
        n_keys = sk
        if causal:
            last = min(row0 + block, sq) - 1
            n_keys = max(0, causal_keys_visible(last, sq, sk))
        n_tiles = (n_keys + bc - 1) // bc
        acc = np.zeros((block, db))
        off = bwd_offsets(p, bwd_index(p, red_mask, owner, 0))
        for red in range(n_red):
            off = bwd_offsets(p, bwd_index(p, red_mask, owner, red))
            q_s = _tile(mem, int(p["q"]), off["q"], row0, block, sq, int(p["q_sr"]), d, db + 1)
            do_s = _tile(mem, int(p["dout"]), off["do"], row0, block, sq, int(p["do_sr"]), dv,
                         dvb + 1)
            lse = np.full(block, -np.inf)
            lsum = np.ones(block)
            delta = np.zeros(block)
            for rr in range(block):
                row = row0 + rr
                if row < sq:
                    lse[rr] = mem.read(int(p["lse"]), [off["lse"] + row * int(p["lse_sr"])])[0]
                    delta[rr] = mem.read(int(p["delta"]), [off["delta"] + row])[0]
            if int(p["lse_acc"]):
                m = np.full(block, -np.inf)
                l = np.zeros(block)
                dsum = np.zeros(block)
                for t in range(n_tiles):
                    key0 = t * bc
                    k_s = _tile(mem, int(p["k"]), off["k"], key0, bc, sk, int(p["k_sr"]), d,
                                db + 1)
                    v_s = _tile(mem, int(p["v"]), off["v"], key0, bc, sk, int(p["v_sr"]), dv,
                                dvb + 1)
                    key = key0 + np.arange(bc)
                    for rr in range(block):
                        row = row0 + rr
                        s = k_s @ q_s[rr]
                        dp = v_s @ do_s[rr]
                        valid = (key < sk) & (row < sq)
                        if causal:
                            valid &= key < causal_keys_visible(row, sq, sk)
                        s = np.where(valid, s * scale, -np.inf)
                        m_new = max(m[rr], s.max())
                        if m_new == -np.inf:
                            continue
                        alpha = np.exp(m[rr] - m_new)
                        e = np.exp(s - m_new)
                        l[rr] = l[rr] * alpha + e.sum()
                        dsum[rr] = dsum[rr] * alpha + np.where(valid, e * dp, 0.0).sum()
                        m[rr] = m_new
                n_rows = _rows_stats(p)
                for rr in range(block):
                    row = row0 + rr
                    empty = l[rr] == 0 or row >= sq
                    lse[rr] = -np.inf if empty else m[rr]
                    lsum[rr] = 1.0 if empty else l[rr]
                    delta[rr] = 0.0 if empty else dsum[rr] / l[rr]
                    if row < sq:
                        mem.write(int(p["lse_acc"]), [off["delta"] + row], [lse[rr]])
                        mem.write(int(p["lse_acc"]), [off["delta"] + row + n_rows], [lsum[rr]])
                        mem.write(int(p["delta"]), [off["delta"] + row], [delta[rr]])
            for t in range(n_tiles):
                key0 = t * bc
                k_s = _tile(mem, int(p["k"]), off["k"], key0, bc, sk, int(p["k_sr"]), d, db + 1)
                v_s = _tile(mem, int(p["v"]), off["v"], key0, bc, sk, int(p["v_sr"]), dv,
                            dvb + 1)
                key = key0 + np.arange(bc)
                for rr in range(block):
                    row = row0 + rr
                    s = k_s @ q_s[rr]
                    dp = v_s @ do_s[rr]
                    valid = (key < sk) & (lse[rr] != -np.inf)
                    if causal:
                        valid &= key < causal_keys_visible(row, sq, sk)
                    with np.errstate(over="ignore", invalid="ignore"):
                        pj = np.where(valid, np.exp(s * scale - lse[rr]) / lsum[rr], 0.0)
                        ds = np.where(valid, pj * (dp - delta[rr]), 0.0)
                    acc[rr] += ds @ k_s[:, :db]
        for rr in range(block):
            row = row0 + rr
            if row >= sq:
                continue
            vals = ref.round_to(acc[rr, :d] * scale, dtype)
            mem.write(int(p["dq"]), off["dq"] + row * int(p["dq_sr"]) + np.arange(d), vals)


def dkdv_pass(mem, p, grid, block, causal, dtype, bc=32):
    sq, sk, d, dv = (int(p[n]) for n in ("sq", "sk", "d", "dv_dim"))
    db = dvb = head_dim_bucket(max(d, dv))
    scale = float(p["scale"])
    nn = int(p["n_nblocks"])
    red_mask = int(p["kv_red"])
    n_rows = _rows_stats(p)
    for bid in range(grid):
        owner = bid // nn
        key0 = (bid % nn) * block
        n_red = reduce_count(p, red_mask)
        first_row = max(0, key0 - (sk - sq)) if causal else 0
        dk_acc = np.zeros((block, db))
        dv_acc = np.zeros((block, dvb))
        off = bwd_offsets(p, bwd_index(p, red_mask, owner, 0))
        for red in range(n_red):
            off = bwd_offsets(p, bwd_index(p, red_mask, owner, red))
            k_s = _tile(mem, int(p["k"]), off["k"], key0, block, sk, int(p["k_sr"]), d, db + 1)
            v_s = _tile(mem, int(p["v"]), off["v"], key0, block, sk, int(p["v_sr"]), dv,
                        dvb + 1)
            for i0 in range(first_row, sq, bc):
                q_s = _tile(mem, int(p["q"]), off["q"], i0, bc, sq, int(p["q_sr"]), d, db + 1)
                do_s = _tile(mem, int(p["dout"]), off["do"], i0, bc, sq, int(p["do_sr"]), dv,
                             dvb + 1)
                lse_s = np.full(bc, -np.inf)
                l_s = np.ones(bc)
                delta_s = np.zeros(bc)
                for idx in range(bc):
                    row = i0 + idx
                    if row >= sq:
                        continue
                    if int(p["lse_acc"]):
                        lse_s[idx] = mem.read(int(p["lse_acc"]), [off["delta"] + row])[0]
                        l_s[idx] = mem.read(int(p["lse_acc"]), [off["delta"] + row + n_rows])[0]
                    else:
                        lse_s[idx] = mem.read(int(p["lse"]),
                                              [off["lse"] + row * int(p["lse_sr"])])[0]
                    delta_s[idx] = mem.read(int(p["delta"]), [off["delta"] + row])[0]
                row = i0 + np.arange(bc)
                for kk in range(block):
                    key = key0 + kk
                    s = q_s @ k_s[kk]
                    dp = do_s @ v_s[kk]
                    valid = (key < sk) & (row < sq) & (lse_s != -np.inf)
                    if causal:
                        valid &= key < np.minimum(row + (sk - sq) + 1, sk)
                    with np.errstate(over="ignore", invalid="ignore"):
                        pj = np.where(valid, np.exp(s * scale - lse_s) / l_s, 0.0)
                        ds = np.where(valid, pj * (dp - delta_s), 0.0)
                    dv_acc[kk] += pj @ do_s[:, :dvb]
                    dk_acc[kk] += ds @ q_s[:, :db]
        for kk in range(block):
            key = key0 + kk
            if key >= sk:
                continue
            mem.write(int(p["dk"]), off["dk"] + key * int(p["dk_sr"]) + np.arange(d),
                      ref.round_to(dk_acc[kk, :d] * scale, dtype))
            mem.write(int(p["dv"]), off["dv"] + key * int(p["dv_sr"]) + np.arange(dv),
                      ref.round_to(dv_acc[kk, :dv], dtype))


def run_plan_launches(mem, launches, causal, dtype):
    """Run the launches recorded from launch_backward: (spec name, grid, threads, params)."""
    for name, grid, threads, params in launches:
        d, dv = int(params["d"]), int(params["dv_dim"])
        nwarps, rows = bwd_generic_config(dtype, head_dim_bucket(max(d, dv)),
                                          head_dim_bucket(max(d, dv)))
        assert threads == 32 * nwarps or "preprocess" in name, (name, threads)
        if "cuflash_bwd_preprocess" in name:
            preprocess(mem, params, grid)
        elif "cuflash_bwd_dq_generic" in name:
            dq_pass(mem, params, grid, block=nwarps * rows, causal=causal, dtype=dtype)
        elif "cuflash_bwd_dkdv_generic" in name:
            dkdv_pass(mem, params, grid, block=nwarps * rows, causal=causal, dtype=dtype)
        else:
            raise AssertionError(f"no model of {name}")
