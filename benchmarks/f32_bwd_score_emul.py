"""Emulation of the generic float32 backward's dv at Sq = 1 (notes/BACKWARD.md, "Open: the float32
generic backward at Sq = 1").

With one query row dv_j = p_j do, so dv's error is p_j's relative error, i.e. the score's
absolute error. This script forms the score dot product in several float32 summation orders
(exact FMA: the product and the add rounded once), then the kernel's softmax (the online max and
sum over 32 lanes and 32-key tiles, the butterfly sum of attn_bwd_generic.cu), then dv, and
compares each with the gradient pass rule (cuflash.reference.grad_pass_threshold) on fresh draws
of (Sq, Sk, D) = (1, 1000, 128), causal, standard normal inputs.

    python benchmarks/f32_bwd_score_emul.py [DRAWS]     # prints, per order: (worst err/thr, fails)
"""
import math
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from cuflash import reference  # noqa: E402

F32, F64 = np.float32, np.float64
D, SK, LANES = 128, 1000, 32
SCALE = F32(1 / math.sqrt(D))


def _fma(acc, a, b):
    """float32 fma(a, b, acc) elementwise: a * b of two float32 values is exact in float64."""
    return (acc.astype(F64) + a.astype(F64) * b.astype(F64)).astype(F32)


def dot(q, k, chains=None, chunk=None):
    """q . k_j for every row of k in float32: `chains` interleaved FMA chains (bwd_dot has 4)
    combined pairwise, or serial chunks of `chunk` terms summed as a pairwise tree; neither: the
    correctly rounded dot product."""
    if chains is None and chunk is None:
        return (k.astype(F64) @ q.astype(F64)).astype(F32)
    if chains is not None:
        parts = [np.zeros(k.shape[0], F32) for _ in range(chains)]
        for c in range(D):
            parts[c % chains] = _fma(parts[c % chains], q[c], k[:, c])
    else:
        parts = []
        for c0 in range(0, D, chunk):
            acc = np.zeros(k.shape[0], F32)
            for c in range(c0, c0 + chunk):
                acc = _fma(acc, q[c], k[:, c])
            parts.append(acc)
    while len(parts) > 1:  # (powers of two here)
        parts = [(parts[i] + parts[i + 1]).astype(F32) for i in range(0, len(parts), 2)]
    return parts[0]


def _exponent(s, m, fused):
    """s * scale - m: two roundings, or one (fused: fma(s, scale, -m))."""
    if fused:
        return (s.astype(F64) * F64(SCALE) - F64(m)).astype(F32)
    return ((s * SCALE).astype(F32) - F32(m)).astype(F32)


def probabilities(s, fused):
    """The kernel's p_j = exp(s_j scale - m) / l: m and l online over tiles of 32 keys, one key
    per lane, then l's butterfly sum over the lanes."""
    st = (s * SCALE).astype(F32)
    m, lanes = -np.inf, np.zeros(LANES, F32)
    for t0 in range(0, s.shape[0], LANES):
        tile = slice(t0, min(s.shape[0], t0 + LANES))
        m_new = max(m, st[tile].max())
        alpha = F32(np.exp(F64(m) - F64(m_new))) if m != -np.inf else F32(0)
        pj = np.zeros(LANES, F32)
        pj[:st[tile].shape[0]] = np.exp(_exponent(s[tile], m_new, fused).astype(F64)).astype(F32)
        lanes = _fma(pj, lanes, np.full(LANES, alpha, F32))
        m = m_new
    for off in (16, 8, 4, 2, 1):
        lanes = (lanes + lanes[np.arange(LANES) ^ off]).astype(F32)
    return (np.exp(_exponent(s, m, fused).astype(F64)).astype(F32) / lanes[0]).astype(F32)


#: name -> (dot keyword arguments, fused exponent); "4 chains" is what the kernel does now.
ORDERS = {
    "4 chains": ({"chains": 4}, False), "4 chains+fma": ({"chains": 4}, True),
    "16 chains": ({"chains": 16}, False), "32 chains": ({"chains": 32}, False),
    "32 chains+fma": ({"chains": 32}, True), "tree of 8": ({"chunk": 8}, False),
    "tree of 8+fma": ({"chunk": 8}, True), "tree of 4+fma": ({"chunk": 4}, True),
    "tree of 16+fma": ({"chunk": 16}, True), "exact": ({}, False), "exact+fma": ({}, True),
}


def main(draws):
    worst = dict.fromkeys(ORDERS, 0.0)
    fails = dict.fromkeys(ORDERS, 0)
    for seed in range(draws):
        rng = np.random.default_rng(1000 + seed)
        q, do = (rng.standard_normal(D).astype(F32) for _ in range(2))
        k, v = (rng.standard_normal((SK, D)).astype(F32) for _ in range(2))
        q64, k64, v64, do64 = (x.astype(F64)[None, None] if x.ndim == 1 else x.astype(F64)[None]
                               for x in (q, k, v, do))
        ref = reference.attention_backward_ref(do64, q64, k64, v64, causal=True,
                                               scale=float(SCALE))
        tols, _ = reference.grad_pass_threshold(do64, q64, k64, v64, causal=True,
                                                scale=float(SCALE), dtype="float32", ref=ref)
        for name, (kw, fused) in ORDERS.items():
            dv = (probabilities(dot(q, k, **kw), fused)[:, None] * do[None, :]).astype(F32)
            ratio = float(np.abs(dv - ref[2][0]).max() / tols[2])
            worst[name] = max(worst[name], ratio)
            fails[name] += ratio > 1
    print(f"draws {draws}")
    for name in ORDERS:
        print(f"  {name:16s} worst err/thr {worst[name]:.3f}   over the rule {fails[name]}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 100)
