"""GPU tests of the user hooks (score_mod / mask_mod, cuflash/mods.py), forward on the generic and
the mma.sync tensor-core kernels (float64: generic only) and, for a few cases, the Hopper kernel
(sm_90), backward on the same family (the tensor-core backward for float16 / bfloat16, the
generic one for float32 / float64; after the Hopper forward the same, and the Hopper backward
at D = 128 / 256: test_hooks_hopper_backward), against the float64
references under the project's pass rule (reference.pass_threshold / grad_pass_threshold), on fresh random inputs with every output
poisoned with NaN: tails, Sq != Sk, causal on and off, broadcast kv heads, a strided q, rows
without keys, hooks composed with built-in parts. Skipped without a GPU."""
import numpy as np
import pytest

import cuflash
from cuflash import MaskMod
from cuflash.mods import HookCompileError, ScoreMod, example_hooks

from gpu_util import bf16_dtype, check_variant_case, cupy, random_inputs, to_gpu

pytestmark = pytest.mark.gpu

from seeds import SEED, case_rng  # noqa: E402  (fresh every run; see pytest's header)
SHAPES = [(7, 7), (113, 250), (1, 40)]
LONG = [(113, 1000), (1000, 113)]         # for a few cases only (the references take seconds)
BATCH_Q, BATCH_KV = (2, 3), (1, 3)        # k and v shared across the leading axis
EX = example_hooks()
EMPTY_ODD = MaskMod("q_idx % 2 == 0 || kv_idx > q_idx + 1000000",
                    numpy=lambda b, h, qi, kj, a: (qi % 2 == 0) | (kj > qi + 1000000))


def _rng(*key):
    return case_rng(SEED, *key)


def _doc_ids(rng, n):
    return np.cumsum(rng.random(n) < 0.05).astype(np.float32)   # documents of ~20 tokens


def _host_hooks(name, rng, sq, sk):
    h = BATCH_Q[-1]
    table = {
        "tanh_cap": lambda: dict(score_mod=EX["tanh_cap"]),
        "rel_bias": lambda: dict(score_mod=EX["rel_bias"],
                                 mod_args=rng.standard_normal(h * 16).astype(np.float32)),
        "document": lambda: dict(mask_mod=EX["document"], mod_args=_doc_ids(rng, max(sq, sk))),
        "prefix_lm": lambda: dict(mask_mod=EX["prefix_lm"]),
        "empty_rows": lambda: dict(mask_mod=EMPTY_ODD, score_mod=EX["tanh_cap"]),
        "composed": lambda: dict(window=(40, 5), alibi_slopes=rng.uniform(0.01, 0.3, (h,))
                                 .astype(np.float32), score_mod=EX["tanh_cap"],
                                 mask_mod=EX["document"], mod_args=_doc_ids(rng, max(sq, sk))),
    }
    return table[name]()


def _to_device(kw):
    cp = cupy()
    return {n: (cp.asarray(x) if isinstance(x, np.ndarray) else x) for n, x in kw.items()}


# Few specialisations (each hook compiles its own kernels): (hook, causal, dtype, strided q).
CASES = [("tanh_cap", False, "float16", False), ("tanh_cap", True, "float16", True),
         ("tanh_cap", False, "float32", False), ("rel_bias", True, "float16", False),
         ("rel_bias", False, "float32", True), ("document", False, "float16", False),
         ("document", True, "float32", False), ("prefix_lm", False, "float16", False),
         ("empty_rows", False, "float32", False), ("composed", True, "bfloat16", False),
         ("composed", False, "float64", False)]


LONG_CASES = [CASES[1], CASES[6], CASES[9]]


def _kernels(dtype):
    return ("generic",) if dtype == "float64" else ("generic", "tensorcore")


# The Hopper forward with hooks (attn_wgmma.cu: cuflash_fwd_wgmma_var, UserVariant), sm_90 only:
# a score hook (strided q), a score hook reading args, a mask hook, rows without keys, hooks on
# built-in parts, in float16, bfloat16 and float32.
HOPPER_CASES = [CASES[1], CASES[2], CASES[3], CASES[6], CASES[8], CASES[9]]


@pytest.mark.parametrize("name,causal,dtype,strided,sq,sk,kernel",
                         [c + s + (kern,) for c in CASES for s in SHAPES
                          for kern in _kernels(c[2])]
                         + [c + s + (kern,) for c in LONG_CASES for s in LONG
                            for kern in _kernels(c[2])]
                         + [c + s + ("hopper",) for c in HOPPER_CASES for s in SHAPES])
def test_hooks_forward_backward(name, causal, dtype, strided, sq, sk, kernel):
    if dtype == "bfloat16" and bf16_dtype() is None:
        pytest.skip("bfloat16 on the GPU needs ml_dtypes")
    if kernel == "hopper" and int(cupy().cuda.Device().compute_capability) != 90:
        pytest.skip("the Hopper kernel runs on compute capability 9.0 only")
    rng = _rng(name, causal, dtype, sq, sk, kernel)
    d = dv = 64
    q, k, v = random_inputs(rng, BATCH_Q, BATCH_KV, sq, sk, d, dv, dtype)
    q = q * 2.0   # scores large enough for the cap to act
    kw = _host_hooks(name, rng, sq, sk)
    dkw = _to_device(kw)
    qg, kg, vg = (to_gpu(x, dtype) for x in (q, k, v))
    if strided:   # q as a (B, S, H, D) buffer seen through a transpose: row stride H * D
        qg = to_gpu(np.ascontiguousarray(np.swapaxes(q, 1, 2)), dtype).swapaxes(1, 2)
        assert sq == 1 or not qg.flags.c_contiguous
    bwd = ("tensorcore" if dtype != "float32" else "generic") if kernel == "hopper" else None
    label, o, lse = check_variant_case(q, k, v, qg, kg, vg, kw, dkw, causal=causal,
                                       dtype=dtype, rng=rng, seed=SEED, kernel=kernel,
                                       bwd_kernel=bwd)
    assert "_mod[" in label, label
    if name == "empty_rows":
        assert np.all(o[..., 1::2, :] == 0) and np.all(np.isneginf(lse[..., 1::2]))


# The hooks on the tensor-core backward with their own tiles (_dispatch_variants.
# TC_BWD_HOOK_CONFIGS), deterministic (a second run equal bit for bit), D = 64 (at D = 128 hooks
# take the generic backward: TC_BWD_HOOK_MAX_D), with a head dim below the bucket (D = 40).
@pytest.mark.parametrize("name,causal,dtype", [("rel_bias", True, "float16"),
                                               ("composed", True, "bfloat16"),
                                               ("empty_rows", False, "float16")])
@pytest.mark.parametrize("d", [64, 40])
def test_hooks_tensorcore_backward_deterministic(name, causal, dtype, d):
    if dtype == "bfloat16" and bf16_dtype() is None:
        pytest.skip("bfloat16 on the GPU needs ml_dtypes")
    rng = _rng("tc-bwd-det", name, causal, dtype, d)
    q, k, v = random_inputs(rng, BATCH_Q, BATCH_KV, 113, 250, d, d, dtype)
    q = q * 2.0
    kw = _host_hooks(name, rng, 113, 250)
    dkw = _to_device(kw)
    qg, kg, vg = (to_gpu(x, dtype) for x in (q, k, v))
    check_variant_case(q, k, v, qg, kg, vg, kw, dkw, causal=causal, dtype=dtype, rng=rng,
                       seed=SEED, kernel="tensorcore", bwd_kernel="tensorcore",
                       deterministic=True)


# The hooks on the Hopper backward (_dispatch_variants.HOPPER_BWD_HOOKS: D = 65..256, sm_90), after
# the Hopper forward: a score hook, a score hook reading args, a mask hook reading args, rows
# without keys, hooks on window and ALiBi (D = 128: the positional parts), deterministic mode
# (bitwise twice), a head dim below its bucket (D = 200 runs the D = 256 form) and tails.
HOPPER_BWD_CASES = [("tanh_cap", True, "float16", 128, False),
                    ("rel_bias", False, "bfloat16", 128, True),
                    ("document", True, "float16", 128, False),
                    ("document", False, "float16", 256, True),
                    ("empty_rows", False, "float16", 128, False),
                    ("composed", True, "float16", 128, True),
                    ("rel_bias", True, "float16", 200, False),
                    ("prefix_lm", False, "bfloat16", 256, False)]


@pytest.mark.parametrize("sq,sk", [(113, 250), (7, 7), (1, 40), (250, 113)])
@pytest.mark.parametrize("name,causal,dtype,d,det", HOPPER_BWD_CASES)
def test_hooks_hopper_backward(name, causal, dtype, d, det, sq, sk):
    if int(cupy().cuda.Device().compute_capability) != 90:
        pytest.skip("the Hopper backward runs on compute capability 9.0 only")
    if dtype == "bfloat16" and bf16_dtype() is None:
        pytest.skip("bfloat16 on the GPU needs ml_dtypes")
    rng = _rng("hopper-bwd", name, causal, dtype, d, det, sq, sk)
    q, k, v = random_inputs(rng, BATCH_Q, BATCH_KV, sq, sk, d, d, dtype)
    q = q * 2.0
    kw = _host_hooks(name, rng, sq, sk)
    dkw = _to_device(kw)
    qg, kg, vg = (to_gpu(x, dtype) for x in (q, k, v))
    label, o, lse = check_variant_case(q, k, v, qg, kg, vg, kw, dkw, causal=causal, dtype=dtype,
                                       rng=rng, seed=SEED, kernel="hopper", bwd_kernel="hopper",
                                       deterministic=det)
    assert "_mod[" in label, label
    if name == "empty_rows":
        assert np.all(o[..., 1::2, :] == 0) and np.all(np.isneginf(lse[..., 1::2]))


def test_hook_compile_error_before_any_launch():
    cp = cupy()
    q = cp.ones((1, 2, 16, 64), dtype=cp.float16)
    bad = ScoreMod("score + not_declared", numpy=lambda s, *r: s)
    with pytest.raises(HookCompileError, match="score_mod, line 1"):
        cuflash.attention(q, q, q, score_mod=bad)


def test_hooks_dispatch():
    """kernel="auto" runs hooks on the mma.sync kernel (named by their hash in the label; on
    sm_90 too while _dispatch_variants.HOPPER_VARIANTS_AUTO is off); kernel="hopper" takes the
    Hopper kernel on sm_90 and elsewhere refuses, naming the hook."""
    from cuflash import _dispatch_variants

    cp = cupy()
    q = cp.ones((1, 2, 64, 64), dtype=cp.float16)
    hopper = int(cp.cuda.Device().compute_capability) == 90
    if hopper:
        label = cuflash.dispatch_info(q, q, q, score_mod=EX["tanh_cap"], kernel="hopper")
        assert label.startswith("hopper<") and "score_mod[" in label, label
    else:
        with pytest.raises(ValueError, match="score_mod"):
            cuflash.attention(q, q, q, score_mod=EX["tanh_cap"], kernel="hopper")
        with pytest.raises(ValueError, match="mask_mod"):
            cuflash.attention(q, q, q, mask_mod=EX["prefix_lm"], kernel="hopper")
    label = cuflash.dispatch_info(q, q, q, mask_mod=EX["prefix_lm"])
    auto = "hopper<" if hopper and _dispatch_variants.HOPPER_VARIANTS_AUTO else "tensorcore<"
    assert label.startswith(auto) and "mask_mod[" in label, label


# ---- HOOK_BLOCKS: the forwards narrow their key tiles to a mask_mod's ranges -------------------
PADDED_DOCS = MaskMod("args[q_idx] == args[kv_idx] && args[q_idx] >= 0",
                      numpy=lambda b, h, qi, kj, a: (a[qi] == a[kj]) & (a[qi] >= 0))


def _blocks_hooks(name, rng, n):
    ids = _doc_ids(rng, n)
    if name == "document":
        return dict(mask_mod=EX["document"], mod_args=ids)
    if name == "long_docs":   # a first document of 100 tokens, then 256-token ones: 64-row
        # blocks inside one see a run of kept key blocks (FULL tiles at 64 and 128 keys), and
        # every shape below narrows (the first rows see keys 0..99 only)
        pos = np.arange(n)
        return dict(mask_mod=EX["document"],
                    mod_args=np.where(pos < 100, 0, 1 + (pos - 100) // 256).astype(np.float32))
    if name == "padded_docs":   # a tail of rows with id -1: whole row blocks see no key
        ids[-max(1, n // 4):] = -1
        return dict(mask_mod=PADDED_DOCS, mod_args=ids)
    return dict(window=(300, -1), alibi_slopes=rng.uniform(0.01, 0.3, (BATCH_Q[-1],))
                .astype(np.float32), score_mod=EX["tanh_cap"], mask_mod=EX["document"],
                mod_args=ids)


def _blocks_case(tag, kernel, dtype, d, causal, name, sq, sk):
    """The inputs of a HOOK_BLOCKS case (skipped where the GPU cannot run it): (rng, host q, k,
    v, device q, k, v, the hooks on the host and on the device)."""
    if kernel == "hopper" and int(cupy().cuda.Device().compute_capability) != 90:
        pytest.skip("the Hopper kernels run on compute capability 9.0 only")
    if dtype == "bfloat16" and bf16_dtype() is None:
        pytest.skip("bfloat16 on the GPU needs ml_dtypes")
    rng = _rng(tag, kernel, dtype, d, causal, name, sq, sk)
    q, k, v = random_inputs(rng, BATCH_Q, BATCH_KV, sq, sk, d, d, dtype)
    kw = _blocks_hooks(name, rng, max(sq, sk))
    return (rng, (q, k, v), tuple(to_gpu(x, dtype) for x in (q, k, v)), kw, _to_device(kw))


@pytest.mark.parametrize("sq,sk", [(300, 700), (700, 300), (7, 130)])
@pytest.mark.parametrize("name", ["document", "long_docs", "padded_docs", "composed"])
@pytest.mark.parametrize("kernel,dtype,d,causal", [("generic", "float32", 64, False),
                                                   ("tensorcore", "float16", 64, True),
                                                   ("tensorcore", "bfloat16", 128, False),
                                                   ("hopper", "float16", 64, False),
                                                   ("hopper", "float16", 128, True),
                                                   ("hopper", "bfloat16", 128, False)])
def test_hook_blocks_forward(monkeypatch, kernel, dtype, d, causal, name, sq, sk):
    """_dispatch_variants.HOOK_BLOCKS: the forward visits only the key tiles of the blocks the
    mask_mod does not hide (its summary's ranges per 64-row block; the case asserts that they
    narrow): against the float64 references under the pass rule with NaN-poisoned outputs
    (and the backward, which keeps the full walk, from that forward), rows whose every key is
    hidden give o = 0 and lse = -inf, and where the plan differs from the flag-off one only by
    the narrowing, o and lse equal the full walk's bit for bit."""
    from cuflash import _dispatch_variants, _mask_blocks
    rng, (q, k, v), (qg, kg, vg), kw, dkw = _blocks_case("hook-blocks", kernel, dtype, d, causal,
                                                         name, sq, sk)
    cp = cupy()
    ranges = _mask_blocks.numpy_hook_ranges(_mask_blocks.numpy_hook_summary(
        kw["mask_mod"], BATCH_Q, sq, sk, kw["mod_args"]), sk)
    assert ranges.shape[:2] == (1, 1)   # batch-free hooks: one summary
    if sk > 64:
        assert np.any(ranges[..., 1] - np.minimum(ranges[..., 0], sk) < sk), ranges
    off = cuflash.dispatch_info(qg, kg, vg, causal=causal, kernel=kernel, **dkw)
    monkeypatch.setattr(_dispatch_variants, "HOOK_BLOCKS", True)
    label, o, lse = check_variant_case(q, k, v, qg, kg, vg, kw, dkw, causal=causal, dtype=dtype,
                                       rng=rng, seed=SEED, kernel=kernel)
    assert "hook-blocks" in label and "hook-blocks" not in off, (label, off)
    if name == "padded_docs":
        pad = kw["mod_args"][:sq] < 0
        assert np.all(o[..., pad, :] == 0) and np.all(np.isneginf(lse[..., pad]))
    if label.replace(",hook-blocks", "") == off:
        monkeypatch.setattr(_dispatch_variants, "HOOK_BLOCKS", False)
        o2, lse2 = cuflash.attention(qg, kg, vg, causal=causal, return_lse=True, kernel=kernel,
                                     **dkw)
        # (check_variant_case returns o and lse as float64: back to the kernel's dtypes,
        # exactly, before comparing bits)
        got = cp.asnumpy(o2)
        bits = np.uint16 if got.itemsize == 2 else np.uint32
        np.testing.assert_array_equal(got.view(bits), o.astype(got.dtype).view(bits))
        np.testing.assert_array_equal(cp.asnumpy(lse2).view(np.uint32),
                                      lse.astype(np.float32).view(np.uint32))


@pytest.mark.parametrize("sq,sk", [(300, 700), (700, 300), (7, 130)])
@pytest.mark.parametrize("name", ["document", "long_docs", "padded_docs", "composed"])
@pytest.mark.parametrize("fwd,bwd,dtype,d,causal", [("generic", "generic", "float32", 64, False),
                                                    ("tensorcore", "tensorcore", "float16", 64,
                                                     True),
                                                    ("hopper", "hopper", "float16", 128, True),
                                                    ("hopper", "hopper", "bfloat16", 256,
                                                     False)])
def test_hook_blocks_backward(monkeypatch, fwd, bwd, dtype, d, causal, name, sq, sk):
    """_dispatch_variants.HOOK_BLOCKS_BWD: the backwards without deterministic turns visit per
    key block only the query tiles of rows the mask_mod's summary does not hide from it, and skip
    the hook on tiles it keeps entirely: dq, dk, dv against the float64 references under the
    rule, with NaN-poisoned outputs, after the flagged forward (check_variant_case); the
    deterministic Hopper and mma.sync backwards keep the full walk (their labels), save the
    deterministic Hopper backward at D = 256 without causal, which refuses the composed hooks'
    ALiBi by design (hopper_bwd_variant_reason); the generic backward (no atomics) gives the
    flag-off gradients bit for bit."""
    from cuflash import _dispatch_variants
    rng, (q, k, v), (qg, kg, vg), kw, dkw = _blocks_case("hook-blocks-bwd", fwd, dtype, d,
                                                         causal, name, sq, sk)
    cp = cupy()
    monkeypatch.setattr(_dispatch_variants, "HOOK_BLOCKS", True)
    monkeypatch.setattr(_dispatch_variants, "HOOK_BLOCKS_BWD", True)
    check_variant_case(q, k, v, qg, kg, vg, kw, dkw, causal=causal, dtype=dtype, rng=rng,
                       seed=SEED, kernel=fwd, bwd_kernel=bwd)
    o, lse = cuflash.attention(qg, kg, vg, causal=causal, return_lse=True, kernel=fwd, **dkw)
    do = to_gpu(rng.standard_normal(o.shape), dtype)
    for det in (False, True):
        try:
            label = cuflash.backward_dispatch_info(do, qg, kg, vg, o, lse, causal=causal,
                                                   deterministic=det, kernel=bwd, **dkw)
        except ValueError as exc:
            # the deterministic Hopper backward at D = 256 without causal takes no policy that
            # reads tensors (the composed hooks' ALiBi): refused by design, and said so
            assert (det and bwd == "hopper" and d > 128 and not causal
                    and "deterministic mode" in str(exc)), exc
            continue
        assert ("hook-blocks" in label) == (bwd == "generic" or not det), label
    if bwd == "generic":
        grads = [cuflash.attention_backward(do, qg, kg, vg, o, lse, causal=causal, kernel=bwd,
                                            **dkw)]
        monkeypatch.setattr(_dispatch_variants, "HOOK_BLOCKS_BWD", False)
        grads.append(cuflash.attention_backward(do, qg, kg, vg, o, lse, causal=causal,
                                                kernel=bwd, **dkw))
        for a, b in zip(*grads):
            np.testing.assert_array_equal(cp.asnumpy(a).view(np.uint32),
                                          cp.asnumpy(b).view(np.uint32))
