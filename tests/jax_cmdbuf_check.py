"""cuflash.jax under XLA command buffers, in a process of its own (XLA reads XLA_FLAGS once, when
JAX starts): run by tests/test_jax_cmdbuf.py, not collected by pytest.

    XLA_FLAGS="--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1
               --xla_dump_to=DIR --xla_dump_hlo_as_text" python tests/jax_cmdbuf_check.py on|off

``on`` calls ``cuflash.jax.attention(..., command_buffer=True)``, ``off`` the default (the
control: the first case, fewer calls). For each case, one jitted forward (with lse) and one jitted grad are called on

- fresh inputs written into the same buffers (the generator donates the previous inputs'
  buffers, so XLA's command buffer finds the addresses it traced and replays the captured
  kernels on new data: stale kernel parameters or a stale workspace would show here),
- fresh inputs in new buffers (XLA traces again: the callback's per-signature record launches
  with the new pointers),
- the same inputs again and again (replays),

and every result is checked against the float64 reference with the project's pass rules
(tests/test_jax.py's checks). Prints one JSON line: how many times the Python callbacks ran
against how many executions, and how often the input addresses repeated.
(``CUFLASH_CMDBUF_CHECK_CPU=1`` runs it on the CPU too, to check the script itself.)
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import cuflash.jax as cj  # noqa: E402
import test_jax as tj  # noqa: E402  (its checks: float64 reference, pass rules)

CASES = [  # dtype, lead, Sq, Sk, causal, H, Hk, D
    ("float16", (2,), 113, 1000, True, 4, 2, 64),
    ("bfloat16", (2,), 1, 1000, False, 8, 1, 64),   # decode shape: split partials workspace
    ("float32", (1,), 7, 7, True, 4, 4, 32),
]
DONATED, FRESH, REPEAT = 3, 2, 6

counts = {"fwd": 0, "bwd": 0}


def _counting(make, name):
    def wrapped(*a):
        cb = make(*a)

        def run(*args, **kw):
            counts[name] += 1
            return cb(*args, **kw)
        return run
    return wrapped


cj._fwd_callback = _counting(cj._fwd_callback, "fwd")
cj._bwd_callback = _counting(cj._bwd_callback, "bwd")


def main():
    mode = sys.argv[1]
    if jax.default_backend() != "gpu" and not os.environ.get("CUFLASH_CMDBUF_CHECK_CPU"):
        print(json.dumps({"skip": f"JAX's default backend is {jax.default_backend()}"}))
        return
    cmdbuf = mode == "on"
    cases, donated, fresh_n = (CASES, DONATED, FRESH) if cmdbuf else (CASES[:1], 1, 1)
    execs = {"fwd": 0, "bwd": 0}
    repeats = 0
    seen = set()

    def gen(old, key):
        return jax.random.normal(key, old.shape, jnp.float32).astype(old.dtype) * 1.5

    regen = jax.jit(gen, donate_argnums=0)   # writes the new values into old's buffer
    fresh = jax.jit(gen)

    for ci, (dtype, lead, sq, sk, causal, h, hk, d) in enumerate(cases):
        shapes = (lead + (sq, h, d), lead + (sk, hk, d), lead + (sk, hk, d), lead + (sq, h, d))
        f = jax.jit(lambda q, k, v, c=causal: cj.attention(q, k, v, causal=c, return_lse=True,
                                                           command_buffer=cmdbuf))

        def loss(q, k, v, do, c=causal):
            o = cj.attention(q, k, v, causal=c, command_buffer=cmdbuf)
            return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32))

        g = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        bufs = [jnp.zeros(s, dtype) + 1 for s in shapes]
        for it in range(donated + fresh_n):
            keys = jax.random.split(jax.random.PRNGKey(1000 * ci + it), 4)
            if it < donated:
                bufs = [regen(b, kk) for b, kk in zip(bufs, keys)]
            else:
                bufs = [fresh(b, kk) for b, kk in zip(bufs, keys)]   # new buffers (old alive)
            ptrs = tuple(b.unsafe_buffer_pointer() for b in bufs)
            repeats += ptrs in seen
            seen.add(ptrs)
            q, k, v, do = bufs
            qn, kn, vn, don = (tj._f64(x) for x in bufs)
            o, lse = f(q, k, v)
            execs["fwd"] += 1
            tj._check_forward(o, qn, kn, vn, causal=causal, dtype=dtype, lse=lse)
            grads = g(q, k, v, do)
            execs["fwd"] += 1
            execs["bwd"] += 1
            tj._check_grads(grads, qn, kn, vn, don, causal=causal, dtype=dtype)
            del o, lse, grads
        if ci == 0:   # the same inputs again: replays (the outputs' buffers come back too)
            q, k, v, do = bufs
            qn, kn, vn, don = (tj._f64(x) for x in bufs)
            for _ in range(REPEAT):
                o, lse = f(q, k, v)
                execs["fwd"] += 1
                tj._check_forward(o, qn, kn, vn, causal=causal, dtype=dtype, lse=lse)
                del o, lse
    print(json.dumps({"mode": mode, "callbacks": counts, "executions": execs,
                      "input_address_repeats": repeats}))


if __name__ == "__main__":
    main()
