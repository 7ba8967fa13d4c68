"""cuflash.jax.attention(command_buffer=True): XLA command buffers (CUDA graphs) around the
buffer callbacks.

GPU: tests/jax_cmdbuf_check.py runs in a subprocess with XLA's command buffers forced on
(XLA_FLAGS is read once, when JAX starts), checks forward and gradients against the float64
reference over calls on fresh inputs in the same and in new buffers, and reports how often the
Python callbacks ran: fewer callbacks than executions means XLA replayed captured work (the
HLO that XLA dumps after optimisation must hold the command-buffer-compatible callback target;
whether it also shows a command-buffer computation depends on the XLA version). The same script
with ``command_buffer=False`` is the control: its callbacks run on every execution and stay
outside command buffers.

CPU (CI): command buffers do not exist there; the option must leave jit, vmap and grad as
they are.
"""
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

jax = pytest.importorskip("jax", reason="JAX is not installed (pip install 'cuflash[jax]')")
import jax.numpy as jnp  # noqa: E402

import cuflash.jax as cj  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
JAX_GPU = jax.default_backend() == "gpu"
NO_JAX_GPU = "JAX's default backend is not a GPU (install a CUDA jaxlib and run on a GPU)"
CMDBUF_FLAGS = "--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1"
TARGET_ON = "xla_buffer_python_gpu_callback_cmd_buffer"
TARGET_OFF = "xla_buffer_python_gpu_callback"


# ---- CPU: the option is accepted and changes nothing ---------------------------------------

def _qkv(seed, lead=(2,), sq=7, sk=13, h=4, hk=2, d=16):
    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(rng.standard_normal(s), jnp.float32)
                 for s in (lead + (sq, h, d), lead + (sk, hk, d), lead + (sk, hk, d)))


def test_cpu_command_buffer_option_changes_nothing():
    """On the CPU command_buffer=True lowers to the same CPU callback: jit, vmap, grad and the
    lse give exactly what the default gives (the same NumPy path)."""
    cpu = jax.devices("cpu")[0]
    q, k, v = (jax.device_put(t, cpu) for t in _qkv(1))

    def run(flag):
        f = jax.jit(lambda q, k, v: cj.attention(q, k, v, causal=True, return_lse=True,
                                                 command_buffer=flag))
        loss = lambda q, k, v: jnp.sum(cj.attention(q, k, v, command_buffer=flag) ** 2)  # noqa
        g = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        vm = jax.jit(jax.vmap(lambda q: cj.attention(q, k, v, command_buffer=flag)))
        return (*f(q, k, v), *g(q, k, v), vm(jnp.stack([q, q * 0.5])))

    with jax.default_device(cpu):  # on a GPU machine too: this is the CPU path's test
        runs = run(False), run(True)
    for a, b in zip(*runs):
        a, b = np.asarray(a), np.asarray(b)
        assert not np.isnan(a).any()
        assert np.array_equal(a, b)


def test_command_buffer_must_be_bool():
    q, k, v = _qkv(2)
    with pytest.raises(TypeError, match="command_buffer must be a bool"):
        cj.attention(q, k, v, command_buffer="yes")


def test_backward_workspace_bound_covers_every_plan():
    """The backward's XLA-owned workspace (one more callback output) bounds what every
    backward plan of these shapes asks for (cuflash._launch.backward_workspace_bytes), with
    room for aligning XLA's buffer to cuflash's 256 bytes, also under vmap's leading axis."""
    import types

    from cuflash import _dispatch, _launch

    for dtype in ("float16", "bfloat16", "float32"):
        for lead, sq, h, d in (((2,), 113, 4, 64), ((), 1, 8, 128), ((3, 2), 1000, 2, 7)):
            q = jax.ShapeDtypeStruct(lead + (sq, h, d), jnp.dtype(dtype))
            ws = cj._bwd_workspace(q, q, q, q)
            nbatch = int(np.prod(lead, dtype=np.int64)) * h
            rows = [0] + ([_dispatch.head_dim_bucket(d, _dispatch.TC_BWD_CONFIGS)
                           + _dispatch.TC_BWD_DQ_PAD] if dtype != "float32" else [])
            for vm in (1, 2, 3):
                for lse_acc in (False, True):
                    for row in rows:
                        plan = types.SimpleNamespace(lse_acc=lse_acc, dq_accum_row=row)
                        prob = types.SimpleNamespace(batch_shape=(vm * nbatch,), sq=sq,
                                                     dtype_name=dtype)
                        need = _launch.backward_workspace_bytes(plan, prob)
                        assert vm * ws.shape[0] - (_launch.WORKSPACE_ALIGN - 1) >= need


@pytest.mark.parametrize("flags", [dict(), dict(TC_BWD_F32_AUTO=False),
                                   dict(HOPPER_BWD_AUTO=False),
                                   dict(TC_BWD_F32_AUTO=False, HOPPER_BWD_AUTO=False)])
def test_backward_workspace_bound_covers_the_dispatchers_plans(flags, monkeypatch):
    """The traced workspace against the plans themselves: for every compute capability the
    dispatcher knows, every kernel choice, deterministic or not, and each head dim, the plan
    `_dispatch.backward_plan_for` returns under the flags now asks for no more than
    `cuflash.jax._bwd_workspace` declares (the test above takes its rows from one table, so it
    could not see a plan of another: the Hopper backward's D = 256, the float32 tensor-core
    form's)."""
    import types

    from cuflash import _dispatch, _launch

    for name, value in flags.items():
        monkeypatch.setattr(_dispatch, name, value)
    lead, h = (2,), 3
    for dtype in ("float16", "bfloat16", "float32", "float64"):
        for sq in (1, 64, 300):
            for d in range(8, 257, 8):
                q = jax.ShapeDtypeStruct(lead + (sq, h, d), jnp.dtype(dtype))
                bound = cj._bwd_workspace(q, q, q, q).shape[0] - (_launch.WORKSPACE_ALIGN - 1)
                for cc in (80, 86, 89, 90):
                    for kernel in ("auto", "tensorcore", "hopper", "generic"):
                        for det in (False, True):
                            prob = types.SimpleNamespace(
                                backend="gpu", dtype_name=dtype, d=d, dv=d, sq=sq, sk=sq,
                                batch_shape=lead + (h,), causal=True, kernel=kernel,
                                deterministic=det, variant=None, precision="highest")
                            try:
                                plan = _dispatch.backward_plan_for(prob, cc)
                            except ValueError:   # a demanded kernel that cannot run these
                                continue
                            need = _launch.backward_workspace_bytes(plan, prob)
                            assert need <= bound, (dtype, sq, d, cc, kernel, det, plan.label)


# ---- GPU: XLA command buffers forced on ----------------------------------------------------

def _computations(hlo):
    """{computation name: body} of an HLO text dump."""
    comps, name, body = {}, None, []
    for line in hlo.splitlines():
        if name is None:
            m = re.match(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
            if m:
                name, body = m.group(1), []
        elif line.startswith("}"):
            comps[name] = "\n".join(body)
            name = None
        else:
            body.append(line)
    return comps


def _run_check(tmp_path, mode):
    dump = tmp_path / f"dump-{mode}"
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + f" {CMDBUF_FLAGS} --xla_dump_to={dump} "
                        "--xla_dump_hlo_as_text").strip()
    proc = subprocess.run([sys.executable, os.path.join(HERE, "jax_cmdbuf_check.py"), mode],
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    comps = {}
    for f in dump.glob("*after_optimizations.txt"):
        comps.update({f"{f.name}:{n}": b for n, b in _computations(f.read_text()).items()})
    return res, comps


def _in_command_buffer(comps, target):
    """(computations holding the custom call `target` that are command buffers, all that hold
    it). XLA's command-buffer scheduling moves each captured run of commands into a
    computation named ``command_buffer...``, called from the schedule; a computation counts as
    one when its name says so or a ``call`` that names it does."""
    pat = f'custom_call_target="{target}"'
    anywhere = [n for n, b in comps.items() if pat in b]
    calls = [ln for b in comps.values() for ln in b.splitlines()
             if "command_buffer" in ln and "to_apply=" in ln]
    inside = [n for n in anywhere if "command_buffer" in n.split(":", 1)[1]
              or any(re.search(r"to_apply=%?" + re.escape(n.split(":", 1)[1]) + r"\b", ln)
                     for ln in calls)]
    return inside, anywhere


@pytest.mark.gpu
@pytest.mark.skipif(not JAX_GPU, reason=NO_JAX_GPU)
def test_gpu_command_buffers_forward_and_grad(tmp_path):
    res, comps = _run_check(tmp_path, "on")
    assert "skip" not in res, res
    inside, anywhere = _in_command_buffer(comps, TARGET_ON)
    assert anywhere, "no command-buffer-compatible callback in the optimised HLO"
    # Whether the callback shows up inside a command-buffer computation of the HLO dump depends on
    # where XLA forms command buffers: with JAX 0.11.2 on the H200 (2026-12-01) the optimised HLO
    # kept it in the entry computation (`inside` empty) while the counts below showed replays
    # (30 forward callbacks for 36 executions). The counts are the evidence that matters: a
    # Python callback that runs on fewer executions than there were can only come from XLA
    # replaying captured work (the control test shows one callback per execution without it).
    ex, cb = res["executions"], res["callbacks"]
    # XLA replayed captured kernels: the Python callbacks ran on fewer executions than there
    # were (each new set of buffer addresses is traced once, repeats replay)
    assert cb["fwd"] < ex["fwd"] and cb["bwd"] <= ex["bwd"], res
    assert res["input_address_repeats"] > 0, res  # donated buffers: the same addresses again


@pytest.mark.gpu
@pytest.mark.skipif(not JAX_GPU, reason=NO_JAX_GPU)
def test_gpu_command_buffers_control_without_option(tmp_path):
    """The control: the same flags without command_buffer=True leave the callback outside
    command buffers, and it runs on every execution (so the counting above can fail)."""
    res, comps = _run_check(tmp_path, "off")
    assert "skip" not in res, res
    inside, anywhere = _in_command_buffer(comps, TARGET_OFF)
    assert anywhere and not inside, (inside, anywhere)
    assert res["callbacks"] == res["executions"], res
