"""Run by tests/test_ring_jax.py in a subprocess with XLA_FLAGS asking for 4 host devices
(it must be set before JAX starts). Judges the JAX ring's forward and gradients against the
float64 references under the project's rules; prints one line per case; exit status 1 on any
failure."""
import sys

import numpy as np


def main():
    import jax

    jax.config.update("jax_enable_x64", False)
    import jax.numpy as jnp
    from jax.sharding import Mesh

    from cuflash import reference
    from cuflash.ring.jax_ring import ring_attention_jax

    devices = jax.devices()
    assert len(devices) >= 4, f"expected 4 host devices, got {len(devices)}"
    failed = 0
    for world in (2, 3, 4):
        mesh = Mesh(np.array(devices[:world]), ("sp",))
        for causal in (False, True):
            rng = np.random.default_rng([world, causal])
            s = 2 * world * 6
            q, k, v, do = (reference.round_to(rng.standard_normal((2, 3, s, 16)), "float32")
                           for _ in range(4))
            o, lse = ring_attention_jax(jnp.asarray(q, jnp.float32), jnp.asarray(k, jnp.float32),
                                        jnp.asarray(v, jnp.float32), mesh=mesh, axis_name="sp",
                                        causal=causal)
            o_ref, lse_ref = reference.attention_ref(q, k, v, causal=causal)
            rule = reference.pass_threshold(q, k, v, causal=causal, dtype="float32", o_ref=o_ref)
            verdict = rule.judge(np.asarray(o, dtype=np.float64))
            lerr = np.abs(np.asarray(lse, dtype=np.float64) - lse_ref)
            ok = verdict.passed and bool(np.all(lerr <= 1e-4 + 1e-5 * np.abs(lse_ref)))

            def loss(q_, k_, v_):
                out, _ = ring_attention_jax(q_, k_, v_, mesh=mesh, axis_name="sp", causal=causal)
                return jnp.sum(out * jnp.asarray(do, jnp.float32))

            grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*(jnp.asarray(x, jnp.float32)
                                                        for x in (q, k, v)))
            g_ref = reference.attention_backward_ref(do, q, k, v, causal=causal)
            tols, _ = reference.grad_pass_threshold(do, q, k, v, causal=causal, dtype="float32",
                                                    ref=g_ref)
            fr = [float(np.abs(np.asarray(g, np.float64) - r).max() / t)
                  for g, r, t in zip(grads, g_ref, tols)]
            ok = ok and max(fr) <= 1
            failed += not ok
            print(f"{'PASS' if ok else 'FAIL'} world={world} causal={causal}: forward err/thr "
                  f"{verdict.frac_threshold:.3f}, lse err {lerr.max():.2e}, grads err/thr "
                  + " ".join(f"{x:.3f}" for x in fr), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
