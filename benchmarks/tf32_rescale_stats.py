"""The one-pass TF32 mode (precision="high") against its rule, with and without the lazy rescale:
a float64 transcription of the kernel's arithmetic (TF32-rounded Q, K, V and P, exact products,
key tiles of 64, the online softmax) on fresh draws of test_head_dims' shape (B*H = 2, Sq = 113,
Sk = 200, D = 64, 100, 128). Prints err/naive statistics and how many draws exceed the 2x-naive
bar, for the lazy rescale (m moves only when the tile's max exceeds it by 2^8 in exp2 units,
common.cuh: RESCALE_LOG2) and for every rescale taken (softmax_step<..., LAZY = false>, what
attn_mma.cu runs for one-pass TF32). No GPU needed; about 3 minutes for 800 draws:
    PYTHONPATH=.:tests python benchmarks/tf32_rescale_stats.py [--draws 800]
(notes/FLOAT32.md has the numbers of 2026-12-01)."""
import math

import click
import numpy as np

from cuflash import reference as ref
from gpu_util import random_inputs


def transcription(q, k, v, scale, threshold, bn=64):
    """float64 output of the one-pass TF32 kernel's arithmetic; `threshold`: the lazy rescale's
    (natural-log units; 0 takes every rescale)."""
    t = ref.round_to_tf32
    s = np.matmul(t(q), np.swapaxes(t(k), -1, -2)) * scale
    tv = t(v)
    m = np.full(s.shape[:-1] + (1,), -np.inf)
    l = np.zeros_like(m)
    o = np.zeros(s.shape[:-1] + (v.shape[-1],))
    for j in range(0, s.shape[-1], bn):
        st = s[..., j:j + bn]
        mx = np.maximum(m, st.max(-1, keepdims=True))
        grow = (mx - m) > threshold
        alpha = np.where(grow, np.exp(m - mx), 1.0)
        m = np.where(grow, mx, m)
        p = np.exp(st - m)
        o = o * alpha + np.matmul(t(p), tv[..., j:j + bn, :])
        l = l * alpha + p.sum(-1, keepdims=True)
    return o / l


@click.command()
@click.option("--draws", default=800, show_default=True, help="fresh inputs per form")
def main(draws):
    lazy_threshold = 8.0 * math.log(2.0)  # 2^8 in exp2 units
    ratios = {"lazy": [], "every rescale": []}
    for seed in range(draws):
        d = (64, 100, 128)[seed % 3]
        q, k, v = random_inputs(np.random.default_rng([9, seed]), (2,), (2,), 113, 200, d, d,
                                "float32")
        o_ref, _ = ref.attention_ref(q, k, v)
        naive = ref.naive_error(q, k, v, dtype="float32", o_ref=o_ref, precision="high")
        for name, thr in (("lazy", lazy_threshold), ("every rescale", 0.0)):
            o = transcription(q, k, v, 1.0 / math.sqrt(d), thr)
            ratios[name].append(float(np.max(np.abs(o - o_ref))) / naive)
    for name, r in ratios.items():
        r = np.array(r)
        print(f"{name:14s}: err/naive median {np.median(r):.2f}, p99 {np.percentile(r, 99):.2f}, "
              f"p99.9 {np.percentile(r, 99.9):.2f}, max {r.max():.2f}; over 2x: {(r > 2).sum()}"
              f" of {len(r)}")


if __name__ == "__main__":
    main()
