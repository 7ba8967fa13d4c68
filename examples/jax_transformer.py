"""A small causal transformer block in JAX, trained for a few steps with cuflash.jax.attention.

Runs on whatever JAX's default device is: on a GPU the cuflash kernels run inside the jitted
training step on XLA's buffers and stream; on the CPU the same code runs cuflash's NumPy path.
The task: predict the next token of sequences that repeat a random pattern, which attention
solves by looking back one period. Prints the loss per step; exits 1 unless it went down.

    python examples/jax_transformer.py
"""
import sys

import jax
import jax.numpy as jnp
import numpy as np

import cuflash.jax as cj

VOCAB, DIM, HEADS, KV_HEADS, SEQ, BATCH, PERIOD = 16, 64, 4, 2, 48, 8, 6
HEAD_DIM = DIM // HEADS


def init(key):
    ks = jax.random.split(key, 6)
    n = lambda k, shape: jax.random.normal(k, shape) / np.sqrt(shape[0])  # noqa: E731
    return {"emb": jax.random.normal(ks[0], (VOCAB, DIM)) * 0.5,
            "pos": jax.random.normal(ks[1], (SEQ, DIM)) * 0.5,
            "wq": n(ks[2], (DIM, HEADS * HEAD_DIM)),
            "wkv": n(ks[3], (DIM, 2 * KV_HEADS * HEAD_DIM)),  # grouped-query: 2 k/v heads
            "wo": n(ks[4], (HEADS * HEAD_DIM, DIM)),
            "out": n(ks[5], (DIM, VOCAB))}


def block(p, tokens):
    """Embedding, one pre-norm causal attention layer with a residual, logits."""
    x = p["emb"][tokens] + p["pos"]                                   # (B, S, DIM)
    h = x / jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)  # RMS norm
    b, s, _ = h.shape
    q = (h @ p["wq"]).reshape(b, s, HEADS, HEAD_DIM)                  # JAX layout (B, S, H, D)
    k, v = jnp.split((h @ p["wkv"]).reshape(b, s, 2 * KV_HEADS, HEAD_DIM), 2, axis=2)
    a = cj.attention(q, k, v, causal=True)                            # (B, S, H, D)
    x = x + a.reshape(b, s, DIM) @ p["wo"]
    return x @ p["out"]


def loss_fn(p, tokens):
    logits = block(p, tokens[:, :-1])
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))


@jax.jit
def step(p, tokens, lr=0.5):
    loss, g = jax.value_and_grad(loss_fn)(p, tokens)
    return jax.tree.map(lambda w, gw: w - lr * gw, p, g), loss


def batch(rng):
    pattern = rng.integers(0, VOCAB, size=(BATCH, PERIOD))
    return jnp.asarray(np.tile(pattern, (1, (SEQ + 1) // PERIOD + 1))[:, :SEQ + 1])


def main(steps=30):
    rng = np.random.default_rng(0)
    p = init(jax.random.PRNGKey(0))
    print(f"JAX {jax.__version__} on {jax.devices()[0]}")
    losses = []
    for i in range(steps):
        p, loss = step(p, batch(rng))
        losses.append(float(loss))
        if i % 5 == 0 or i == steps - 1:
            print(f"step {i:3d}  loss {losses[-1]:.4f}")
    first, last = np.mean(losses[:3]), np.mean(losses[-3:])
    ok = np.isfinite(losses).all() and last < 0.7 * first
    print(f"loss {first:.4f} -> {last:.4f}: {'went down' if ok else 'did NOT go down'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
