"""Attention on PyTorch (and, if installed, JAX) GPU tensors through DLPack, without copies.

cuflash returns CuPy arrays; ``torch.from_dlpack`` / ``jax.dlpack.from_dlpack`` view them
without a copy. Launches go to CuPy's current stream: when your framework works on another
stream, pass it (``stream=torch.cuda.current_stream()``).

    python examples/dlpack_interop.py      # needs a CUDA GPU, CuPy and PyTorch and/or JAX
"""
import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # let JAX share the GPU

import cuflash  # noqa: E402

ran = False
try:
    import torch
except ImportError:
    torch = None

if torch is not None and torch.cuda.is_available():
    q, k, v = (torch.randn(2, 4, 512, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    o = cuflash.attention(q, k, v, causal=True, stream=torch.cuda.current_stream())
    o_t = torch.from_dlpack(o)                      # a torch tensor sharing o's memory
    ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(),
                                                           is_causal=True)
    print("torch:", o_t.shape, o_t.dtype, "max err vs fp32 SDPA:", (o_t.float() - ref).abs().max().item())
    ran = True

try:
    import jax
    import jax.numpy as jnp
except ImportError:
    jax = None

if jax is not None and any(d.platform == "gpu" for d in jax.devices()):
    key = jax.random.PRNGKey(0)
    q, k, v = (jax.random.normal(kk, (2, 4, 256, 64), dtype=jnp.float16)
               for kk in jax.random.split(key, 3))
    o = cuflash.attention(q, k, v)                   # JAX arrays expose __dlpack__
    o_j = jax.dlpack.from_dlpack(o)
    print("jax:", o_j.shape, o_j.dtype)
    ran = True

if not ran:
    print("neither PyTorch nor JAX with a GPU is available; nothing to show")
