"""Emulation of the generic float32 backward's dv at Sq = 1 (notes/BACKWARD.md, "Open: the float32
generic backward at Sq = 1"): the score dot in several float32 summation orders (exact FMA), the
online max and sum over 32 lanes and the butterfly sum of attn_bwd_generic.cu, then dv = p * do,
compared with the gradient pass rule (cuflash.reference.grad_pass_threshold) on fresh draws.

    python benchmarks/f32_bwd_score_emul.py 300     # draws; prints (worst error / threshold, fails)
"""
import math
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from cuflash import reference as R
f32, f64 = np.float32, np.float64  # noqa: E702
D, sk = 128, 1000; scale = f32(1/math.sqrt(D))
def dot(q, K, nch):
    parts = np.zeros((nch, K.shape[0]), f32)
    for c in range(0, D, nch):
        for u in range(nch):
            parts[u] = (parts[u].astype(f64) + f64(q[c+u])*K[:, c+u].astype(f64)).astype(f32)
    while parts.shape[0] > 1:
        h = parts.shape[0]//2; parts = (parts[:h] + parts[h:]).astype(f32)
    return parts[0]
def dot_tree(q, K, chunk):
    # serial FMA chunks of `chunk` terms, then a pairwise tree over the chunks
    sums = []
    for c0 in range(0, D, chunk):
        acc = np.zeros(K.shape[0], f32)
        for c in range(c0, c0 + chunk):
            acc = (acc.astype(f64) + f64(q[c])*K[:, c].astype(f64)).astype(f32)
        sums.append(acc)
    while len(sums) > 1:
        sums = [(sums[i] + sums[i+1]).astype(f32) for i in range(0, len(sums), 2)]
    return sums[0]
def arg(s, m, fma):
    return (s.astype(f64)*f64(scale) - f64(m)).astype(f32) if fma else ((s*scale).astype(f32) - f32(m)).astype(f32)
def pvec(s, fma):
    st = (s*scale).astype(f32)
    n = s.shape[0]; m = -np.inf; l = np.zeros(32, f32)
    for t in range((n+31)//32):
        seg = slice(t*32, min(n, (t+1)*32)); w = st[seg].shape[0]
        m_new = max(m, st[seg].max())
        alpha = f32(np.exp(f64(m) - f64(m_new))) if m != -np.inf else f32(0)
        pj = np.zeros(32, f32); pj[:w] = np.exp(arg(s[seg], m_new, fma).astype(f64)).astype(f32)
        l = (l.astype(f64)*alpha + pj).astype(f32); m = m_new
    for off in (16, 8, 4, 2, 1): l = (l + l[np.arange(32) ^ off]).astype(f32)
    e = np.exp(arg(s, m, fma).astype(f64)).astype(f32)
    return (e / l[0]).astype(f32)
cfg = {"now(4ch)": (4, False), "4ch+fma": (4, True), "16ch": (16, False), "32ch": (32, False),
       "32ch+fma": (32, True), "tree8": (-8, False), "tree8+fma": (-8, True),
       "tree4+fma": (-4, True), "tree16+fma": (-16, True), "exact": (0, False),
       "exact+fma": (0, True)}
worst = {c: 0 for c in cfg}; fails = {c: 0 for c in cfg}
N = int(sys.argv[1]) if len(sys.argv) > 1 else 100
for seed in range(N):
    rng = np.random.default_rng(1000 + seed)
    q = rng.standard_normal((1, D)).astype(f32); k = rng.standard_normal((sk, D)).astype(f32)
    v = rng.standard_normal((sk, D)).astype(f32); do = rng.standard_normal((1, D)).astype(f32)
    q64, k64, v64, do64 = (x.astype(f64)[None] for x in (q, k, v, do))
    ref = R.attention_backward_ref(do64, q64, k64, v64, causal=True, scale=float(scale))
    tols, naive = R.grad_pass_threshold(do64, q64, k64, v64, causal=True, scale=float(scale), dtype="float32", ref=ref)
    for c, (nch, fma) in cfg.items():
        s = dot_tree(q[0], k, -nch) if nch < 0 else dot(q[0], k, nch) if nch else (q.astype(f64) @ k.T.astype(f64))[0].astype(f32)
        p = pvec(s, fma)
        dv = (p[:, None] * do[0][None, :]).astype(f32)
        r = np.abs(dv - ref[2][0]).max() / tols[2]
        worst[c] = max(worst[c], r); fails[c] += r > 1
print("seeds", N, {c: (round(float(worst[c]), 3), int(fails[c])) for c in cfg})
