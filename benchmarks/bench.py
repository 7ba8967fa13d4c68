#!/usr/bin/env python
"""Forward-attention benchmark: cuflash against PyTorch SDPA backends and a plain CuPy baseline.

Run from the repository root::

    PYTHONPATH=. python benchmarks/bench.py                 # the default grid
    PYTHONPATH=. python benchmarks/bench.py --quick         # a few points, for a smoke test
    PYTHONPATH=. python benchmarks/bench.py --d 128 --s 1024,4096 --causal 1 \
        --json /tmp/bench.json --markdown /tmp/bench.md

Every point of the grid has B * S tokens and H * D model width fixed (16384 and 2048 by default),
so the work per point grows linearly with S. For each point and implementation the script

1. makes random normal inputs once (torch.randn on the GPU when PyTorch is present, shared with
   CuPy through DLPack; cupy.random otherwise) and uses the same q, k, v for every implementation;
2. runs the implementation once and checks a few (batch, head) slices of its output against a
   float64 CPU reference (cuflash.reference.attention_ref) by the project's pass rule,
   cuflash.reference.pass_threshold: at most twice the error of a naive same-precision
   implementation on the same slices plus a small absolute term, and within the a-priori
   forward-error bound element by element. A failing implementation is not timed;
3. runs --warmup untimed calls, then --repeats calls each bracketed by CUDA events on the stream
   the implementation runs on, and reports the median (min, max and all samples go to --json).

FLOPs per point: 4 * B * H * Sq * Sk * D (two matmuls of 2 * Sq * Sk * D each per head),
halved when causal. TFLOP/s = FLOPs / median seconds / 1e12.

``--pass backward`` times the backward pass instead (cuflash.attention_backward against torch's
FLASH, CUDNN and EFFICIENT backward through torch.autograd.grad on a retained graph, so only the
backward runs in the timed calls), with an upstream gradient do drawn like the inputs; every
result's dq, dk and dv are first checked on whole (batch, head) slices against float64 gradients
computed on the GPU, under cuflash.reference's gradient rule (twice the error of a naive
same-precision backward plus the small absolute term; see BackwardCheckSet). FLOPs are 2.5x the
forward's (five matmuls instead of two). ``cuflash-det`` is cuflash with deterministic=True;
``cuflash-hopper`` / ``cuflash-hopper-det`` force the Hopper backward (kernel="hopper", sm_90a)
in both modes, ``cuflash-hopper-ov`` / ``cuflash-hopper-ov-det`` the same with the D = 256 form's
overlapped schedule (_dispatch.HOPPER_BWD_OVERLAP; other head dims run what cuflash-hopper runs),
``cuflash-tensorcore`` the mma.sync one (float32: its split-precision "3xfp16"
form, which kernel="auto" takes too: _dispatch.TC_BWD_F32_AUTO), ``cuflash-tensorcore-det``
that one with deterministic=True.

See benchmarks/README.md for the method in prose.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import time
import traceback
import warnings

import numpy as np

# ---------------------------------------------------------------------------------------------
# constants
# ---------------------------------------------------------------------------------------------

TOKENS = 16384                     # B * S at every point
WIDTH = 2048                       # H * D at every point
DEFAULT_D = (64, 128, 256)
DEFAULT_S = (512, 1024, 2048, 4096, 8192, 16384)
DEFAULT_CAUSAL = (0, 1)
DEFAULT_DTYPES = ("float16",)
QUICK_D = (64, 128)
QUICK_S = (1024, 4096)
QUICK_REPEATS = 5
QUICK_WARMUP = 2
DEFAULT_REPEATS = 30
DEFAULT_WARMUP = 5

# Implementations in table order. cuflash-tensorcore forces the mma.sync kernel (what "auto" runs
# before Hopper, and for float32 at head dims the Hopper form does not take), cuflash-hopper
# the Hopper kernel (for float32 "highest" its fp16-split form, 3xfp16: _dispatch.HOPPER_F32_FORM;
# cuflash-hopper-3xtf32 its 3xTF32 wgmma form; cuflash-hopper-high its one-pass TF32 form;
# cuflash-hopper-hsplit the same with _dispatch.HOPPER_F32_D256 on: float32 "highest" at
# D = 129..256 in the 3xfp16 form whose two consumers share the head dim; cuflash-hopper-presplit
# that form with K and V split once per call, _dispatch.HOPPER_F32_PRESPLIT, and D = 256 on;
# cuflash-hopper-inplace the 3xfp16 form splitting K and V per tile, HOPPER_F32_PRESPLIT off),
# cuflash-tc-3xtf32 the mma.sync kernel's 3xTF32 form of "highest" (cuflash-tensorcore runs its
# fp16-split form, 3xfp16: _dispatch.TC_F32_FORM), cuflash-generic the scalar audit kernel: all
# off by default.
IMPLS = ("cuflash", "cuflash-det", "cuflash-high", "cuflash-tensorcore", "cuflash-tc-3xtf32",
         "cuflash-tensorcore-det", "cuflash-hopper", "cuflash-hopper-det",
         "cuflash-hopper-3xtf32", "cuflash-hopper-high", "cuflash-hopper-hsplit",
         "cuflash-hopper-presplit", "cuflash-hopper-inplace", "cuflash-hopper-ov",
         "cuflash-hopper-ov-det", "cuflash-generic",
         "torch-flash",
         "torch-cudnn",
         "torch-efficient", "torch-math", "cupy-naive")
DEFAULT_IMPLS = ("cuflash", "torch-flash", "torch-cudnn", "torch-efficient", "cupy-naive")
# float32 (--dtype float32): cuflash's float32-accurate default and its one-pass TF32 mode
# (precision="high"), against torch's two float32 SDPA backends (FLASH and CUDNN refuse float32).
FLOAT32_IMPLS = ("cuflash", "cuflash-high", "torch-efficient", "torch-math", "cupy-naive")
#: --pass backward: cuflash (and deterministic=True) against torch's three fused backwards; for
#: float32 against EFFICIENT, the one fused torch backward that takes float32.
BACKWARD_IMPLS = ("cuflash", "cuflash-det", "torch-flash", "torch-cudnn", "torch-efficient")
BACKWARD_FLOAT32_IMPLS = ("cuflash", "cuflash-det", "cuflash-tensorcore", "cuflash-tensorcore-det",
                          "torch-efficient")
#: Backward FLOPs per forward FLOP: dS = ..., dQ, dK, dV and the recomputed S: 5 matmuls vs 2.
BACKWARD_FLOP_FACTOR = 2.5
#: --pass backward: the issue's grid starts at S = 1024.
BACKWARD_DEFAULT_S = (1024, 2048, 4096, 8192, 16384)
IMPL_ALIASES = {
    "det": "cuflash-det",
    "flash": "torch-flash", "cudnn": "torch-cudnn", "efficient": "torch-efficient",
    "mem-efficient": "torch-efficient", "naive": "cupy-naive", "generic": "cuflash-generic",
    "tensorcore": "cuflash-tensorcore", "high": "cuflash-high", "math": "torch-math",
    "hopper": "cuflash-hopper", "hopper-det": "cuflash-hopper-det",
}
# The peers the speed ratios are taken against, with the column title of each ratio.
RATIO_PEERS = (("torch-flash", "cuflash/FLASH"), ("torch-cudnn", "cuflash/CUDNN"),
               ("torch-efficient", "cuflash/EFF"), ("torch-math", "cuflash/MATH"),
               ("cuflash-det", "cuflash/det"))  # the last: what deterministic=True costs

FALLBACK_L2_BYTES = 50 * 1024 ** 2
SUPPORTED_DTYPES = ("float16", "bfloat16", "float32")
ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4}


# ---------------------------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------------------------

def _int_list(text):
    try:
        vals = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    if not vals or any(v <= 0 for v in vals):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return tuple(dict.fromkeys(vals))


def _causal_list(text):
    table = {"0": 0, "1": 1, "false": 0, "true": 1, "off": 0, "on": 1, "no": 0, "yes": 1}
    vals = []
    for t in text.replace(" ", "").lower().split(","):
        if not t:
            continue
        if t not in table:
            raise argparse.ArgumentTypeError(f"causal values are 0/1 (or off/on), got {t!r}")
        vals.append(table[t])
    if not vals:
        raise argparse.ArgumentTypeError("empty --causal list")
    return tuple(dict.fromkeys(vals))


def _dtype_list(text):
    alias = {"fp16": "float16", "half": "float16", "float16": "float16",
             "bf16": "bfloat16", "bfloat16": "bfloat16", "fp32": "float32", "float32": "float32",
             "float": "float32"}
    vals = []
    for t in text.replace(" ", "").lower().split(","):
        if not t:
            continue
        if t not in alias:
            raise argparse.ArgumentTypeError(
                f"unsupported dtype {t!r}; choose from {', '.join(SUPPORTED_DTYPES)}")
        vals.append(alias[t])
    if not vals:
        raise argparse.ArgumentTypeError("empty --dtype list")
    return tuple(dict.fromkeys(vals))


def _impl_list(text):
    vals = []
    for t in text.replace(" ", "").lower().split(","):
        if not t:
            continue
        if t == "all":
            vals.extend(IMPLS)
            continue
        if t == "default":
            vals.extend(DEFAULT_IMPLS)
            continue
        name = IMPL_ALIASES.get(t, t)
        if name not in IMPLS:
            raise argparse.ArgumentTypeError(
                f"unknown implementation {t!r}; choose from {', '.join(IMPLS)}, 'default' or 'all'")
        vals.append(name)
    if not vals:
        raise argparse.ArgumentTypeError("empty --impl list")
    chosen = set(vals)
    return tuple(n for n in IMPLS if n in chosen)      # table order


def _nonneg_int(text):
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}")
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}")
    return v


def _pos_int(text):
    v = _nonneg_int(text)
    if v == 0:
        raise argparse.ArgumentTypeError("expected a positive integer")
    return v


def _pos_float(text):
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}")
    if not v > 0:
        raise argparse.ArgumentTypeError("expected a positive number")
    return v


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="bench.py",
        description="Time cuflash.attention against torch SDPA (FLASH, CUDNN, EFFICIENT) and a "
                    "plain CuPy matmul-softmax-matmul, after checking every result.")
    p.add_argument("--d", type=_int_list, default=None, metavar="LIST",
                   help=f"head dims (default {','.join(map(str, DEFAULT_D))})")
    p.add_argument("--s", type=_int_list, default=None, metavar="LIST",
                   help=f"sequence lengths, Sq = Sk (default {','.join(map(str, DEFAULT_S))})")
    p.add_argument("--causal", type=_causal_list, default=None, metavar="LIST",
                   help="0 and/or 1 (default 0,1)")
    p.add_argument("--dtype", type=_dtype_list, default=None, metavar="LIST",
                   help="float16, bfloat16 and/or float32 (default float16)")
    p.add_argument("--impl", type=_impl_list, default=None, metavar="LIST",
                   help=f"implementations among {', '.join(IMPLS)}; 'all' or 'default' "
                        f"(default: {','.join(DEFAULT_IMPLS)})")
    p.add_argument("--repeats", type=_pos_int, default=None,
                   help=f"timed calls per implementation and point (default {DEFAULT_REPEATS}; "
                        f"{QUICK_REPEATS} with --quick)")
    p.add_argument("--warmup", type=_nonneg_int, default=None,
                   help=f"untimed calls before timing (default {DEFAULT_WARMUP}; "
                        f"{QUICK_WARMUP} with --quick)")
    p.add_argument("--tokens", type=_pos_int, default=TOKENS,
                   help="B * S at every point (default %(default)s)")
    p.add_argument("--width", type=_pos_int, default=WIDTH,
                   help="H * D at every point (default %(default)s)")
    p.add_argument("--pass", dest="pass_", choices=("forward", "backward"), default="forward",
                   help="time the forward pass (default) or the backward pass (dq, dk, dv)")
    p.add_argument("--quick", action="store_true",
                   help=f"smoke test: D in {QUICK_D}, S in {QUICK_S}, causal 0/1, "
                        f"{QUICK_REPEATS} repeats (explicit options still win)")
    p.add_argument("--json", metavar="PATH", default=None,
                   help="write the header, every timing and the summary as JSON")
    p.add_argument("--markdown", metavar="PATH", default=None,
                   help="write the header and the table as Markdown")
    p.add_argument("--seed", type=_nonneg_int, default=0,
                   help="base random seed (default %(default)s)")
    p.add_argument("--check-slices", type=_pos_int, default=2,
                   help="(batch, head) slices compared against the float64 reference per point "
                        "(default %(default)s)")
    p.add_argument("--check-rows", type=_nonneg_int, default=1024,
                   help="query rows per checked slice, a contiguous block; 0 = all rows "
                        "(default %(default)s)")
    p.add_argument("--naive-max-gb", type=_pos_float, default=40.0,
                   help="skip cupy-naive where its S x S intermediates would exceed this many GB "
                        "(default %(default)s)")
    p.add_argument("--time-cap", type=_pos_float, default=15.0,
                   help="seconds of warm-up plus timed calls allowed per implementation and "
                        "point; slower implementations get fewer repeats, at least 3 "
                        "(default %(default)s)")
    args = p.parse_args(argv)

    args.d = args.d or (QUICK_D if args.quick else DEFAULT_D)
    args.s = args.s or (QUICK_S if args.quick else
                        (BACKWARD_DEFAULT_S if args.pass_ == "backward" else DEFAULT_S))
    args.causal = args.causal or DEFAULT_CAUSAL
    args.dtype = args.dtype or DEFAULT_DTYPES
    if args.impl is None and args.pass_ == "backward":
        args.impl = BACKWARD_FLOAT32_IMPLS if args.dtype == ("float32",) else BACKWARD_IMPLS
    if args.impl is None:
        args.impl = FLOAT32_IMPLS if args.dtype == ("float32",) else DEFAULT_IMPLS
    if args.repeats is None:
        args.repeats = QUICK_REPEATS if args.quick else DEFAULT_REPEATS
    if args.warmup is None:
        args.warmup = QUICK_WARMUP if args.quick else DEFAULT_WARMUP

    bad_s = [s for s in args.s if args.tokens % s]
    bad_d = [d for d in args.d if args.width % d]
    if bad_s:
        p.error(f"every S must divide --tokens={args.tokens}; not {bad_s}")
    if bad_d:
        p.error(f"every D must divide --width={args.width}; not {bad_d}")
    return args


def build_points(args):
    """The grid, one dict per point, in table order (dtype, D, S, causal)."""
    pts = []
    for dtype in args.dtype:
        for d in args.d:
            for s in args.s:
                for c in args.causal:
                    pts.append({"dtype": dtype, "D": d, "S": s, "B": args.tokens // s,
                                "H": args.width // d, "causal": bool(c)})
    return pts


def attention_flops(b, h, sq, sk, d, causal):
    """FLOPs of one forward pass: two matmuls (Q K^T and P V), 2*Sq*Sk*D each, per (batch, head).

    flops = 4 * B * H * Sq * Sk * D, halved for causal masking (about half the scores are used;
    the diagonal's extra Sq/2 scores are ignored, as is customary). The softmax is not counted.
    """
    f = 4.0 * b * h * sq * sk * d
    return f / 2.0 if causal else f


# ---------------------------------------------------------------------------------------------
# small utilities
# ---------------------------------------------------------------------------------------------

def log(msg):
    print(msg, file=sys.stderr, flush=True)


def short_reason(exc, limit=110):
    """One line naming an exception: 'Type: first line of the message', cut to `limit` chars."""
    text = str(exc).strip().splitlines()
    first = text[0].strip() if text else ""
    # torch's "No available kernel" warnings put the useful part after the first line.
    reason = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
    return reason if len(reason) <= limit else reason[: limit - 3] + "..."


def geomean(vals):
    vals = [v for v in vals if v is not None and v > 0 and math.isfinite(v)]
    if not vals:
        return None
    return math.exp(sum(math.log(v) for v in vals) / len(vals))


def _is_oom(exc):
    name = type(exc).__name__
    return "OutOfMemory" in name or "out of memory" in str(exc).lower()


# ---------------------------------------------------------------------------------------------
# optional libraries
# ---------------------------------------------------------------------------------------------

class Env:
    """What could be imported, and why not."""

    def __init__(self):
        self.cupy = None
        self.cupy_err = None
        self.torch = None
        self.torch_err = None
        self.sdpa = None            # (sdpa_kernel, SDPBackend)
        self.sdpa_err = None
        self.cuflash = None
        self.cuflash_err = None
        self.ref = None             # cuflash.reference
        self.ref_err = None

        try:
            import cupy
            cupy.cuda.runtime.getDeviceCount()
            self.cupy = cupy
        except Exception as e:  # noqa: BLE001 - anything that stops CuPy from working
            self.cupy_err = short_reason(e)

        try:
            import torch
            if not torch.cuda.is_available():
                raise RuntimeError("torch.cuda.is_available() is False")
            self.torch = torch
        except Exception as e:  # noqa: BLE001
            self.torch_err = short_reason(e)
        if self.torch is not None:
            try:
                from torch.nn.attention import SDPBackend, sdpa_kernel
                self.sdpa = (sdpa_kernel, SDPBackend)
            except Exception as e:  # noqa: BLE001
                self.sdpa_err = short_reason(e)
        else:
            self.sdpa_err = f"torch unavailable ({self.torch_err})"

        try:
            import cuflash
            self.cuflash = cuflash
        except Exception as e:  # noqa: BLE001
            self.cuflash_err = short_reason(e)
        try:
            from cuflash import reference
            self.ref = reference
        except Exception as e:  # noqa: BLE001
            self.ref_err = short_reason(e)


def _nvidia_smi_driver():
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        line = out.stdout.strip().splitlines()
        return line[0].strip() if out.returncode == 0 and line else None
    except Exception:  # noqa: BLE001
        return None


def _cuda_version(v):
    """12040 -> '12.4'."""
    try:
        v = int(v)
        return f"{v // 1000}.{(v % 1000) // 10}"
    except Exception:  # noqa: BLE001
        return str(v)


def collect_header(env, args):
    """Everything needed to reproduce or interpret a run."""
    h = {
        "date_utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "command": shlex.join([os.path.basename(sys.executable) or "python"] + sys.argv),
        "argv": list(sys.argv),
        "python_executable": sys.executable,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "hostname": platform.node(),
        "pythonpath": os.environ.get("PYTHONPATH", ""),
        "numpy": np.__version__,
    }
    try:
        import scipy
        h["scipy"] = scipy.__version__
    except Exception:  # noqa: BLE001
        h["scipy"] = None
    cp = env.cupy
    if cp is not None:
        h["cupy"] = cp.__version__
        try:
            dev = cp.cuda.Device()
            props = cp.cuda.runtime.getDeviceProperties(dev.id)
            name = props.get("name", b"")
            h["gpu"] = name.decode(errors="replace") if isinstance(name, bytes) else str(name)
            h["gpu_index"] = dev.id
            h["compute_capability"] = f"{props.get('major')}.{props.get('minor')}"
            h["gpu_memory_gib"] = round(props.get("totalGlobalMem", 0) / 2 ** 30, 1)
            h["sm_count"] = props.get("multiProcessorCount")
            h["l2_cache_mib"] = round(props.get("l2CacheSize", 0) / 2 ** 20, 1)
        except Exception as e:  # noqa: BLE001
            h["gpu"] = f"unknown ({short_reason(e)})"
        try:
            h["cuda_driver_api"] = _cuda_version(cp.cuda.runtime.driverGetVersion())
        except Exception:  # noqa: BLE001
            h["cuda_driver_api"] = None
        try:
            h["cuda_runtime"] = _cuda_version(cp.cuda.runtime.runtimeGetVersion())
        except Exception:  # noqa: BLE001
            h["cuda_runtime"] = None
        try:
            from cupy_backends.cuda.libs import nvrtc
            h["nvrtc"] = ".".join(str(x) for x in nvrtc.getVersion())
        except Exception as e:  # noqa: BLE001
            h["nvrtc"] = f"unknown ({short_reason(e)})"
    else:
        h["cupy"] = f"unavailable ({env.cupy_err})"
    h["driver"] = _nvidia_smi_driver()
    if env.torch is not None:
        t = env.torch
        h["torch"] = t.__version__
        h["torch_cuda"] = t.version.cuda
        try:
            h["cudnn"] = t.backends.cudnn.version()
        except Exception:  # noqa: BLE001
            h["cudnn"] = None
        if h.get("gpu") is None:
            h["gpu"] = t.cuda.get_device_name()
    else:
        h["torch"] = f"unavailable ({env.torch_err})"
    if env.cuflash is not None:
        h["cuflash"] = getattr(env.cuflash, "__version__", "unknown")
        h["cuflash_path"] = os.path.dirname(getattr(env.cuflash, "__file__", "") or "")
    else:
        h["cuflash"] = f"unavailable ({env.cuflash_err})"
    h["reference"] = ("cuflash.reference" if env.ref is not None
                      else f"built-in fallback (cuflash.reference unavailable: {env.ref_err})")
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10,
                             cwd=os.path.dirname(os.path.abspath(__file__)))
        h["git_commit"] = rev.stdout.strip() if rev.returncode == 0 else None
    except Exception:  # noqa: BLE001
        h["git_commit"] = None
    h["settings"] = {
        "tokens_B_times_S": args.tokens, "width_H_times_D": args.width,
        "repeats": args.repeats, "warmup": args.warmup, "check_slices": args.check_slices,
        "check_rows": args.check_rows, "naive_max_gb": args.naive_max_gb,
        "time_cap_s": args.time_cap, "seed": args.seed, "impls": list(args.impl),
        "pass": args.pass_,
    }
    return h


# ---------------------------------------------------------------------------------------------
# float64 reference on the CPU (cuflash.reference, or a small stand-in if it cannot be imported)
# ---------------------------------------------------------------------------------------------

_UNIT = {"float16": 2.0 ** -11, "bfloat16": 2.0 ** -8, "float32": 2.0 ** -24}


def _fb_round(x, dtype):
    x = np.asarray(x, dtype=np.float64)
    if dtype == "float16":
        with np.errstate(over="ignore"):
            return x.astype(np.float16).astype(np.float64)
    if dtype == "bfloat16":       # via float32, round to nearest even on the bit pattern
        u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
        u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
        return u.astype(np.uint32).view(np.float32).astype(np.float64)
    return x.astype(np.float32).astype(np.float64)


def _fb_scores(q, k, scale, causal, dt):
    s = (q.astype(dt) @ k.astype(dt).T) * dt(scale)
    if causal:
        sq, sk = s.shape
        keep = np.arange(sk)[None, :] <= np.arange(sq)[:, None] + (sk - sq)
        s = np.where(keep, s, -np.inf)
    return s


def _fb_softmax(s):
    s = s - s.max(axis=-1, keepdims=True)
    e = np.exp(s)
    return e / e.sum(axis=-1, keepdims=True)


def reference_f64(env, q, k, v, causal, scale):
    if env.ref is not None:
        return np.asarray(env.ref.attention_ref(q, k, v, causal=causal, scale=scale)[0])
    return _fb_softmax(_fb_scores(q, k, scale, causal, np.float64)) @ v


def naive_same_precision(env, q, k, v, causal, scale, dtype, precision=None):
    if env.ref is not None:
        return np.asarray(env.ref.naive_attention(q, k, v, causal=causal, scale=scale,
                                                  dtype=dtype, precision=precision))
    s = _fb_round(_fb_scores(q, k, scale, causal, np.float32), dtype)
    p = _fb_round(_fb_softmax(s.astype(np.float32)), dtype)
    return _fb_round(p.astype(np.float32) @ v.astype(np.float32), dtype)


def pass_threshold(env, dtype, o_ref, naive_err):
    """The fallback 2x-naive threshold, used only when cuflash.reference is not importable
    (otherwise CheckSet takes the project's rule, cuflash.reference.pass_threshold)."""
    return 2.0 * naive_err + 2.0 * _UNIT[dtype] * float(np.max(np.abs(o_ref)))


def to_host_f64(x, env):
    """A GPU (CuPy or torch) or NumPy array -> NumPy float64, bfloat16 included."""
    if isinstance(x, np.ndarray):
        return x.astype(np.float64)
    t = env.torch
    if t is not None and isinstance(x, t.Tensor):
        return x.detach().to(t.float64).cpu().numpy()
    cp = env.cupy
    if str(x.dtype) == "bfloat16":
        # bfloat16 is the top half of a float32: widen the bit pattern, no ml_dtypes needed.
        bits = cp.asnumpy(cp.ascontiguousarray(x).view(cp.uint16)).astype(np.uint32) << 16
        return bits.view(np.float32).astype(np.float64)
    return cp.asnumpy(x).astype(np.float64)


class CheckSet:
    """The slices compared at one point, with their float64 reference and pass threshold.

    A slice is (b, h, r0, r1, k_end): query rows [r0, r1) of batch b, head h against keys
    [0, k_end). For causal attention k_end = r1: with bottom-right alignment, query row r0 + a of
    the block (Sq' = r1 - r0 rows, Sk' = r1 keys) sees keys j <= a + r0, exactly as in the full
    problem, so the block's reference is the full problem's rows.
    """

    def __init__(self, env, pt, q, k, v, scale, n_slices, rows, seed, precision=None):
        self.env = env
        self.dtype = pt["dtype"]
        self.precision = precision  # float32 "high": the one-pass TF32 naive sets the bar
        b_all, h_all, s = pt["B"], pt["H"], pt["S"]
        rng = np.random.default_rng(seed)
        pairs = [(b, h) for b in range(b_all) for h in range(h_all)]
        pick = rng.choice(len(pairs), size=min(n_slices, len(pairs)), replace=False)
        m = s if rows == 0 else min(rows, s)
        self.slices = []
        for i, idx in enumerate(pick):
            b, h = pairs[int(idx)]
            # The first slice takes the last rows (they see every key, causal or not).
            r0 = s - m if i == 0 else int(rng.integers(0, s - m + 1))
            r1 = r0 + m
            k_end = r1 if pt["causal"] else s
            self.slices.append((b, h, r0, r1, k_end))
        self.refs, self.tols, self.naive_errs, self.rules = [], [], [], []
        for (b, h, r0, r1, k_end) in self.slices:
            qs = to_host_f64(q[b, h, r0:r1], env)
            ks = to_host_f64(k[b, h, :k_end], env)
            vs = to_host_f64(v[b, h, :k_end], env)
            ref = reference_f64(env, qs, ks, vs, pt["causal"], scale)
            if env.ref is not None:
                # The project's one rule: the 2x-naive threshold and the a-priori bound.
                rule = env.ref.pass_threshold(qs, ks, vs, causal=pt["causal"], scale=scale,
                                              dtype=self.dtype, o_ref=ref, precision=precision)
                nerr, tol = rule.naive_err, rule.threshold
            else:
                rule = None
                naive = naive_same_precision(env, qs, ks, vs, pt["causal"], scale, self.dtype,
                                             precision)
                nerr = float(np.max(np.abs(naive - ref)))
                tol = pass_threshold(env, self.dtype, ref, nerr)
            self.refs.append(ref)
            self.rules.append(rule)
            self.naive_errs.append(nerr)
            self.tols.append(tol)
        self.last_bound_ratio = None

    def check(self, out):
        """(passed, max_abs_err, worst err/threshold ratio) for an output of the full shape;
        the worst fraction of the a-priori bound is left in `last_bound_ratio` (None without
        cuflash.reference)."""
        worst_err, worst_ratio, worst_bound, ok = 0.0, 0.0, 0.0, True
        self.last_bound_ratio = None
        for (b, h, r0, r1, _), ref, tol, rule in zip(self.slices, self.refs, self.tols,
                                                      self.rules):
            got = to_host_f64(out[b, h, r0:r1], self.env)
            if got.shape != ref.shape:
                raise ValueError(f"output slice has shape {got.shape}, expected {ref.shape}")
            if not np.all(np.isfinite(got)):
                return False, float("nan"), float("inf")
            if rule is not None:
                verdict = rule.judge(got)
                err, ratio = verdict.max_abs_err, verdict.frac_threshold
                worst_bound = max(worst_bound, verdict.frac_bound)
                ok = ok and verdict.passed
            else:
                err = float(np.max(np.abs(got - ref)))
                ratio = err / tol if tol > 0 else (0.0 if err == 0 else float("inf"))
                ok = ok and err <= tol
            worst_err = max(worst_err, err)
            worst_ratio = max(worst_ratio, ratio)
        if self.rules and self.rules[0] is not None:
            self.last_bound_ratio = worst_bound
        return ok, worst_err, worst_ratio

    def summary(self):
        return {"slices": [list(s) for s in self.slices],
                "naive_fp_err": self.naive_errs, "threshold": self.tols}


# ---------------------------------------------------------------------------------------------
# backward: float64 gradients and the naive same-precision backward, on the GPU
# ---------------------------------------------------------------------------------------------
# GPU twins (any array module xp: CuPy here, NumPy in tests/test_backward_cpu.py, which checks
# them against cuflash.reference.attention_backward_ref, naive_attention_backward and
# gradient_scales) for one (Sq, D) head: a whole head of the benchmark's sizes (S up to 16384)
# is out of reach of the CPU reference in the time of a run.

def _xp_round(xp, x, dtype):
    """float32 values rounded to dtype (nearest even), kept in float32."""
    if dtype == "float16":
        return x.astype(xp.float16).astype(xp.float32)
    if dtype == "bfloat16":
        u = xp.ascontiguousarray(x, dtype=xp.float32).view(xp.uint32).astype(xp.uint64)
        u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
        return u.astype(xp.uint32).view(xp.float32)
    return x


def _xp_mask(xp, sq, sk):
    return xp.arange(sk)[None, :] <= xp.arange(sq)[:, None] + (sk - sq)


def grad_reference_xp(xp, q, k, v, do, causal, scale):
    """float64 (dq, dk, dv) and the terms' sizes (A_dq, A_dk, A_dv) of one head, as
    cuflash.reference.attention_backward_ref and gradient_scales define them."""
    q, k, v, do = (x.astype(xp.float64) for x in (q, k, v, do))
    s = (q @ k.T) * scale
    if causal:
        s = xp.where(_xp_mask(xp, *s.shape), s, -xp.inf)
    s -= s.max(axis=-1, keepdims=True)
    p = xp.exp(s)
    del s
    p /= p.sum(axis=-1, keepdims=True)
    o = p @ v
    dv = p.T @ do
    dp = do @ v.T
    delta = (do * o).sum(axis=-1, keepdims=True)
    ds = p * (dp - delta)
    dq, dk = scale * (ds @ k), scale * (ds.T @ q)
    del ds
    g = p * (xp.abs(dp) + xp.abs(delta))
    del dp
    a = (abs(scale) * float((g @ xp.abs(k)).max()), abs(scale) * float((g.T @ xp.abs(q)).max()),
         float((p.T @ xp.abs(do)).max()))
    return (dq, dk, dv), a


def grad_naive_xp(xp, q, k, v, do, causal, scale, dtype):
    """The naive same-precision backward of one head (cuflash.reference.naive_attention_backward):
    products in float32, every stage's result rounded to dtype."""
    f32 = xp.float32
    q, k, v, do = (x.astype(f32) for x in (q, k, v, do))
    s = _xp_round(xp, (q @ k.T) * f32(scale), dtype)
    if causal:
        s = xp.where(_xp_mask(xp, *s.shape), s, f32(-np.inf))
    e = xp.exp(s - s.max(axis=-1, keepdims=True))
    del s
    p = _xp_round(xp, e / e.sum(axis=-1, keepdims=True, dtype=f32), dtype)
    del e
    dv = _xp_round(xp, p.T @ do, dtype)
    dp = _xp_round(xp, do @ v.T, dtype)
    ds = _xp_round(xp, p * (dp - (p * dp).sum(axis=-1, keepdims=True, dtype=f32)), dtype)
    del dp, p
    dq = _xp_round(xp, (ds @ k) * f32(scale), dtype)
    dk = _xp_round(xp, (ds.T @ q) * f32(scale), dtype)
    return dq, dk, dv


class BackwardCheckSet:
    """--pass backward: whole (batch, head) slices with their float64 gradients and, per
    gradient, the pass threshold of cuflash.reference.tolerance (2 x the naive same-precision
    backward's error + 4 u A_X), computed on the GPU in float64 / float32."""

    def __init__(self, env, pt, s, scale, n_slices, seed):
        self.env, self.dtype = env, pt["dtype"]
        # The a-priori bound models the forward only; gradients are judged by the threshold.
        self.last_bound_ratio = None
        cp = env.cupy
        rng = np.random.default_rng(seed)
        pairs = [(b, h) for b in range(pt["B"]) for h in range(pt["H"])]
        pick = rng.choice(len(pairs), size=min(n_slices, len(pairs)), replace=False)
        self.slices = [pairs[int(i)] for i in pick]
        self.refs, self.tols, self.naive_errs = [], [], []
        for b, h in self.slices:
            x = [self._gpu_f32(t[b, h]) for t in (s.cq, s.ck, s.cv, s.cdo)]
            ref, scales = grad_reference_xp(cp, *x, pt["causal"], scale)
            naive = grad_naive_xp(cp, *x, pt["causal"], scale, self.dtype)
            errs = [float(cp.abs(n.astype(cp.float64) - r).max()) for n, r in zip(naive, ref)]
            del naive
            self.refs.append(ref)
            self.naive_errs.append(errs)
            self.tols.append([float(env.ref.tolerance(self.dtype, None, e, out_scale=a))
                              for e, a in zip(errs, scales)])
            free_gpu_memory(env)

    def _gpu_f32(self, x):
        cp = self.env.cupy
        if str(x.dtype) == "bfloat16":
            bits = cp.ascontiguousarray(x).view(cp.uint16).astype(cp.uint32) << 16
            return bits.view(cp.float32)
        return x.astype(cp.float32)

    def check(self, grads):
        """(passed, max abs error, worst err / threshold) over the slices and dq, dk, dv."""
        cp = self.env.cupy
        worst_err, worst_ratio, ok = 0.0, 0.0, True
        for (b, h), refs, tols in zip(self.slices, self.refs, self.tols):
            for g, ref, tol in zip(grads, refs, tols):
                got = cp.from_dlpack(g[b, h]) if not isinstance(g, cp.ndarray) else g[b, h]
                got = self._gpu_f32(got).astype(cp.float64)
                if got.shape != ref.shape:
                    raise ValueError(f"gradient slice has shape {got.shape}, expected "
                                     f"{ref.shape}")
                if not bool(cp.all(cp.isfinite(got))):
                    return False, float("nan"), float("inf")
                err = float(cp.abs(got - ref).max())
                worst_err = max(worst_err, err)
                ratio = err / tol if tol > 0 else (0.0 if err == 0 else float("inf"))
                worst_ratio = max(worst_ratio, ratio)
                ok = ok and err <= tol
        return ok, worst_err, worst_ratio

    def summary(self):
        return {"slices": [list(x) for x in self.slices], "naive_fp_err": self.naive_errs,
                "threshold": self.tols, "gradients": ["dq", "dk", "dv"]}


# ---------------------------------------------------------------------------------------------
# inputs
# ---------------------------------------------------------------------------------------------

class InputSet:
    """q, k, v of shape (B, H, S, D), contiguous; `t*` torch tensors (or None), `c*` CuPy views."""

    def __init__(self, tq, tk, tv, cq, ck, cv):
        self.tq, self.tk, self.tv = tq, tk, tv
        self.cq, self.ck, self.cv = cq, ck, cv
        self.tdo = self.cdo = None  # the upstream gradient, --pass backward only
        self.cupy_err = None

    def any(self):
        """Some view of (q, k, v) for the correctness reference."""
        if self.tq is not None:
            return self.tq, self.tk, self.tv
        return self.cq, self.ck, self.cv


def make_inputs(env, pt, n_sets, seed, with_do=False):
    shape = (pt["B"], pt["H"], pt["S"], pt["D"])
    sets = []
    cp = env.cupy
    for i in range(n_sets):
        if env.torch is not None:
            t = env.torch
            dt = getattr(t, pt["dtype"])
            g = t.Generator(device="cuda")
            g.manual_seed(seed * 1000 + i)
            tq, tk, tv = (t.randn(shape, device="cuda", dtype=dt, generator=g) for _ in range(3))
            s = InputSet(tq, tk, tv, None, None, None)
            if with_do:
                s.tdo = t.randn(shape, device="cuda", dtype=dt, generator=g)
            if cp is not None:
                try:
                    s.cq, s.ck, s.cv = (cp.from_dlpack(x) for x in (tq, tk, tv))
                    if with_do:
                        s.cdo = cp.from_dlpack(s.tdo)
                except Exception as e:  # noqa: BLE001 - e.g. a CuPy without bfloat16
                    s.cupy_err = f"CuPy cannot view {pt['dtype']} torch tensors: {short_reason(e)}"
            else:
                s.cupy_err = f"CuPy unavailable ({env.cupy_err})"
        else:
            rs = cp.random.RandomState(seed * 1000 + i)
            if pt["dtype"] == "bfloat16":
                import ml_dtypes  # CuPy's bfloat16 dtype comes from ml_dtypes
                dt = ml_dtypes.bfloat16
            else:
                dt = cp.dtype(pt["dtype"])
            cq, ck, cv = (rs.standard_normal(shape, dtype=cp.float32).astype(dt)
                          for _ in range(3))
            s = InputSet(None, None, None, cq, ck, cv)
            if with_do:
                s.cdo = rs.standard_normal(shape, dtype=cp.float32).astype(dt)
        sets.append(s)
    return sets


def input_sets_needed(set_bytes, l2_bytes):
    """1 if one (q, k, v) set already exceeds 3x L2; else 2 or 3 sets rotated between calls."""
    if set_bytes >= 3 * l2_bytes:
        return 1
    return 2 if 2 * set_bytes >= 3 * l2_bytes else 3


# ---------------------------------------------------------------------------------------------
# implementations
# ---------------------------------------------------------------------------------------------

class Skip(Exception):
    """Raised by an implementation to record a point as skipped (not an error)."""


class Impl:
    name = "?"
    #: cuflash must pass the correctness check to be timed; a peer that misses the threshold is
    #: timed anyway and its error shown (the float32 peers' errors are part of what is compared).
    must_pass = True
    #: float32 product mode whose naive counterpart sets the check's bar (None: the dtype's own).
    precision = None

    def __init__(self, env, args):
        self.env, self.args = env, args
        self.notes = {}

    def unavailable(self):
        """A reason string if this implementation cannot run at all in this environment."""
        return None

    def context(self):
        return contextlib.nullcontext()

    def stream(self):
        """The CuPy stream object its work is queued on (used for events and the spin kernel)."""
        cp = self.env.cupy
        return cp.cuda.get_current_stream()

    def prepare(self, pt, sets, scale):
        """Returns run(i) -> output, launching one call on input set i; may raise Skip."""
        raise NotImplementedError

    def prepare_backward(self, pt, sets, scale):
        """--pass backward: run(i) -> (dq, dk, dv) for input set i (its forward done here,
        untimed); may raise Skip."""
        raise Skip("n/a: no backward pass")

    def explain(self, exc):
        """A short reason for an exception this implementation raised."""
        return short_reason(exc)


class CuflashImpl(Impl):

    def __init__(self, env, args, kernel, precision=None, deterministic=False, f32_form=None,
                 form_table="HOPPER_F32_FORM", settings=None):
        super().__init__(env, args)
        # {name: value} of _dispatch constants set while this implementation runs
        self.settings = dict(settings or {})
        self.kernel = kernel
        self.precision = precision
        self.deterministic = deterministic
        # the float32 form's table in place of _dispatch.<form_table> (HOPPER_F32_FORM for the
        # Hopper kernel, TC_F32_FORM for the mma.sync one)
        self.f32_form = f32_form
        self.form_table = form_table
        self.name = "cuflash" if kernel == "auto" else f"cuflash-{kernel}"
        if precision is not None:
            self.name = f"cuflash-{precision}" if kernel == "auto" else f"{self.name}-{precision}"
        if deterministic:
            self.name = "cuflash-det" if kernel == "auto" else f"cuflash-{kernel}-det"
        if f32_form is not None:
            self.name = f"{self.name}-{f32_form.get('highest', '3xtf32')}"
        self.use_out = True

    @contextlib.contextmanager
    def context(self):
        """With f32_form: _dispatch.<form_table> replaced while this implementation runs (and
        each of `settings`)."""
        settings = dict(self.settings)
        if self.f32_form is not None:
            settings[self.form_table] = self.f32_form
        if not settings:
            yield
            return
        from cuflash import _dispatch
        saved = {k: getattr(_dispatch, k) for k in settings}
        for k, v in settings.items():
            setattr(_dispatch, k, v)
        try:
            yield
        finally:
            for k, v in saved.items():
                setattr(_dispatch, k, v)

    def unavailable(self):
        if self.deterministic and self.args.pass_ != "backward":
            return "deterministic= is an option of the backward pass (--pass backward)"
        if self.env.cuflash is None:
            return f"cuflash not importable ({self.env.cuflash_err})"
        if self.env.cupy is None:
            return f"CuPy unavailable ({self.env.cupy_err})"
        return None

    def dispatch(self, pt, sets):
        s = sets[0]
        if self.args.pass_ == "backward":
            return getattr(self, "backward_label", "?")
        with self.context():
            return str(self.env.cuflash.dispatch_info(s.cq, s.ck, s.cv, causal=pt["causal"],
                                                      kernel=self.kernel,
                                                      precision=self.precision))

    def prepare_backward(self, pt, sets, scale):
        """The forward of every input set (o, lse) is run here, untimed; a timed call is one
        attention_backward into preallocated dq, dk, dv with a preallocated workspace."""
        cp, cf = self.env.cupy, self.env.cuflash
        if sets[0].cq is None:
            raise Skip(f"n/a: {sets[0].cupy_err}")
        if self.precision is not None:
            raise Skip("n/a: the backward has no precision= modes")
        causal, kernel, det = pt["causal"], self.kernel, self.deterministic
        stream = self.stream()
        fwd = [cf.attention(s.cq, s.ck, s.cv, causal=causal, scale=scale, return_lse=True,
                            stream=stream) for s in sets]
        s0 = sets[0]
        args0 = (s0.cdo, s0.cq, s0.ck, s0.cv) + fwd[0]
        self.backward_label = str(cf.backward_dispatch_info(*args0, causal=causal,
                                                            deterministic=det, kernel=kernel))
        ws = cp.empty(cf.attention_backward_workspace_size(*args0, causal=causal,
                                                           deterministic=det, kernel=kernel),
                      dtype=cp.uint8)
        outs = tuple(cp.empty_like(x) for x in (s0.cq, s0.ck, s0.cv))

        def run(i):
            s = sets[i]
            return cf.attention_backward(s.cdo, s.cq, s.ck, s.cv, *fwd[i], causal=causal,
                                         scale=scale, deterministic=det, out=outs, workspace=ws,
                                         stream=stream, kernel=kernel)
        return run

    def prepare(self, pt, sets, scale):
        cp, cf = self.env.cupy, self.env.cuflash
        if sets[0].cq is None:
            raise Skip(f"n/a: {sets[0].cupy_err}")
        out = cp.empty(sets[0].cq.shape, dtype=sets[0].cq.dtype)
        stream = self.stream()
        causal, kernel, precision = pt["causal"], self.kernel, self.precision

        def run(i):
            s = sets[i]
            if self.use_out:
                try:
                    r = cf.attention(s.cq, s.ck, s.cv, causal=causal, scale=scale, out=out,
                                     stream=stream, kernel=kernel, precision=precision)
                    return out if r is None else r
                except (TypeError, ValueError) as e:
                    # Only give up on out= if the call works without it.
                    r = cf.attention(s.cq, s.ck, s.cv, causal=causal, scale=scale,
                                     stream=stream, kernel=kernel, precision=precision)
                    self.use_out = False
                    self.notes["out="] = f"rejected, timed with allocation ({short_reason(e)})"
                    return r
            return cf.attention(s.cq, s.ck, s.cv, causal=causal, scale=scale, stream=stream,
                                kernel=kernel, precision=precision)
        return run


class TorchSDPAImpl(Impl):
    BACKENDS = {"torch-flash": "FLASH_ATTENTION", "torch-cudnn": "CUDNN_ATTENTION",
                "torch-efficient": "EFFICIENT_ATTENTION", "torch-math": "MATH"}
    must_pass = False

    def __init__(self, env, args, name):
        super().__init__(env, args)
        self.name = name
        self.backend_name = self.BACKENDS[name]

    def unavailable(self):
        if self.env.torch is None:
            return f"torch not importable ({self.env.torch_err})"
        if self.env.sdpa is None:
            return f"torch.nn.attention.sdpa_kernel unavailable ({self.env.sdpa_err})"
        if self.env.cupy is None:
            return f"CuPy unavailable for timing ({self.env.cupy_err})"
        if not hasattr(self.env.sdpa[1], self.backend_name):
            return f"SDPBackend.{self.backend_name} not in this torch"
        return None

    @contextlib.contextmanager
    def context(self):
        sdpa_kernel, backend = self.env.sdpa
        with warnings.catch_warnings(record=True) as caught:
            # A backend that cannot take the inputs warns why, then raises "No available
            # kernel": keep the warnings quiet and use them to explain the error (see explain).
            warnings.simplefilter("always")
            self._caught = caught
            with sdpa_kernel(getattr(backend, self.backend_name)):
                yield

    def explain(self, exc):
        msgs = []
        for w in getattr(self, "_caught", None) or []:
            lines = str(w.message).strip().splitlines()
            first = lines[0].strip() if lines else ""
            if first and "not used because" not in first and first not in msgs:
                msgs.append(first)
        reason = short_reason(exc, 80)
        if msgs:
            reason += " (" + "; ".join(msgs[:2]) + ")"
        return reason if len(reason) <= 200 else reason[:197] + "..."

    def stream(self):
        cp = self.env.cupy
        ptr = self.env.torch.cuda.current_stream().cuda_stream
        cur = cp.cuda.get_current_stream()
        if ptr == cur.ptr:
            return cur
        return cp.cuda.ExternalStream(ptr)

    def prepare(self, pt, sets, scale):
        F = self.env.torch.nn.functional
        causal = pt["causal"]

        def run(i):
            s = sets[i]
            return F.scaled_dot_product_attention(s.tq, s.tk, s.tv, is_causal=causal,
                                                  scale=scale)
        return run

    def prepare_backward(self, pt, sets, scale):
        """The forward of every set runs here (inside this backend's context, so autograd
        records this backend's backward), untimed; a timed call is torch.autograd.grad of the
        retained graph: the backward kernels alone."""
        t = self.env.torch
        F = t.nn.functional
        graphs = []
        for s in sets:
            leaves = tuple(x.detach().requires_grad_() for x in (s.tq, s.tk, s.tv))
            o = F.scaled_dot_product_attention(*leaves, is_causal=pt["causal"], scale=scale)
            graphs.append((o, leaves, s.tdo))

        def run(i):
            o, leaves, do = graphs[i]
            return t.autograd.grad(o, leaves, grad_outputs=do, retain_graph=True)
        return run


class CupyNaiveImpl(Impl):
    must_pass = False

    """matmul -> softmax -> matmul in CuPy, the way one would write it by hand.

    S = q @ k^T by cuBLAS on the half-precision inputs (float32 accumulation, result in the input
    dtype), cast to float32; scale, mask, max-subtracted softmax in float32 in place; P cast back
    to the input dtype; O = P @ v. Peak memory is about 6 bytes per score (the dtype scores, then
    the float32 copy, then P reusing the first buffer from CuPy's pool).
    """
    name = "cupy-naive"
    BYTES_PER_SCORE = 6

    def unavailable(self):
        if self.env.cupy is None:
            return f"CuPy unavailable ({self.env.cupy_err})"
        return None

    def memory_bytes(self, pt):
        scores = pt["B"] * pt["H"] * pt["S"] * pt["S"]
        extra = 8 * pt["S"] * pt["S"] if pt["causal"] else 0      # the float32 mask (and its temp)
        return self.BYTES_PER_SCORE * scores + extra

    def prepare(self, pt, sets, scale):
        cp = self.env.cupy
        need = self.memory_bytes(pt)
        if need > self.args.naive_max_gb * 1e9:
            raise Skip(f"skipped: memory ({need / 1e9:.0f} GB > {self.args.naive_max_gb:g} GB)")
        if sets[0].cq is None:
            raise Skip(f"n/a: {sets[0].cupy_err}")
        try:   # CuPy 14's matmul has no bfloat16 path: say so plainly rather than "data type 'E'"
            probe = sets[0].cq[:1, :1, :1, :]
            cp.matmul(probe, probe.swapaxes(-1, -2))
        except Exception as e:  # noqa: BLE001
            raise Skip(f"n/a: cupy.matmul cannot take {pt['dtype']} ({short_reason(e, 60)})")
        s_len = pt["S"]
        bias = None
        if pt["causal"]:
            # Additive mask: 0 where key j <= query i (Sq == Sk, so bottom-right == top-left).
            bias = cp.triu(cp.full((s_len, s_len), -cp.inf, dtype=cp.float32), k=1)
        f32 = cp.float32
        stream = self.stream()

        def run(i):
            x = sets[i]
            with stream:
                s16 = cp.matmul(x.cq, x.ck.swapaxes(-1, -2))
                s = s16.astype(f32)
                del s16
                s *= f32(scale)
                if bias is not None:
                    s += bias
                m = s.max(axis=-1, keepdims=True)
                s -= m
                cp.exp(s, out=s)
                s /= s.sum(axis=-1, keepdims=True)
                p = s.astype(x.cq.dtype)
                del s
                return cp.matmul(p, x.cv)
        return run


def make_impls(env, args):
    impls = []
    for name in args.impl:
        if name == "cuflash":
            impls.append(CuflashImpl(env, args, "auto"))
        elif name == "cuflash-det":
            impls.append(CuflashImpl(env, args, "auto", deterministic=True))
        elif name == "cuflash-high":
            impls.append(CuflashImpl(env, args, "auto", precision="high"))
        elif name in ("cuflash-generic", "cuflash-tensorcore", "cuflash-hopper"):
            impls.append(CuflashImpl(env, args, name.split("-", 1)[1]))
        elif name == "cuflash-hopper-det":  # --pass backward: the Hopper backward, deterministic
            impls.append(CuflashImpl(env, args, "hopper", deterministic=True))
        elif name == "cuflash-hopper-hsplit":  # float32 D = 129..256 on the Hopper 3xfp16 form
            impl = CuflashImpl(env, args, "hopper", settings={"HOPPER_F32_D256": True})
            impl.name = name
            impls.append(impl)
        elif name in ("cuflash-hopper-presplit", "cuflash-hopper-inplace"):  # float32 3xfp16,
            # K and V split once a call or per tile
            impl = CuflashImpl(env, args, "hopper", settings={
                "HOPPER_F32_D256": True, "HOPPER_F32_PRESPLIT": name.endswith("presplit")})
            impl.name = name
            impls.append(impl)
        elif name in ("cuflash-hopper-ov", "cuflash-hopper-ov-det"):  # --pass backward, D = 256
            impl = CuflashImpl(env, args, "hopper", deterministic=name.endswith("-det"),
                               settings={"HOPPER_BWD_OVERLAP": True})
            impl.name = name
            impls.append(impl)
        elif name == "cuflash-tensorcore-det":  # --pass backward: mma.sync, deterministic
            impls.append(CuflashImpl(env, args, "tensorcore", deterministic=True))
        elif name == "cuflash-hopper-high":
            impls.append(CuflashImpl(env, args, "hopper", precision="high"))
        elif name == "cuflash-hopper-3xtf32":  # "highest" in its 3xTF32 wgmma form
            impls.append(CuflashImpl(env, args, "hopper", f32_form={}))
        elif name == "cuflash-tc-3xtf32":  # "highest" in the mma.sync kernel's 3xTF32 form
            impl = CuflashImpl(env, args, "tensorcore", f32_form={}, form_table="TC_F32_FORM")
            impl.name = name
            impls.append(impl)
        elif name in TorchSDPAImpl.BACKENDS:
            impls.append(TorchSDPAImpl(env, args, name))
        elif name == "cupy-naive":
            impls.append(CupyNaiveImpl(env, args))
    return impls


# ---------------------------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------------------------

_SPIN_SRC = r"""
extern "C" __global__ void bench_spin(unsigned long long ns) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    } while (t - t0 < ns);
}
"""


class Spinner:
    """A one-thread kernel that keeps the stream busy for a while.

    Queued before the timed calls so that the host can enqueue all of them (and their events)
    while the GPU waits: the events then measure GPU time, not Python launch overhead.
    """

    def __init__(self, cp):
        self.cp = cp
        self.kernel = None
        self.err = None
        try:
            self.kernel = cp.RawKernel(_SPIN_SRC, "bench_spin")
            self.kernel.compile()
        except Exception as e:  # noqa: BLE001
            self.kernel, self.err = None, short_reason(e)

    def __call__(self, stream, seconds):
        if self.kernel is None or seconds <= 0:
            return
        self.kernel((1,), (1,), (np.uint64(int(seconds * 1e9)),), stream=stream)


def time_impl(cp, run, stream, n_sets, warmup, repeats, time_cap, spinner):
    """Warm up, then time `repeats` calls with events; returns (times_ms, repeats_used, warmup)."""
    # One synchronised call to size the rest (the correctness call already compiled everything).
    t0 = time.perf_counter()
    run(1 % n_sets)
    stream.synchronize()
    per_call = max(time.perf_counter() - t0, 1e-6)
    budget_calls = int(time_cap / per_call)
    warmup = min(warmup, max(0, budget_calls // 6))
    repeats = max(3, min(repeats, budget_calls - warmup))

    host = []
    for i in range(warmup):
        h0 = time.perf_counter()
        run((2 + i) % n_sets)
        host.append(time.perf_counter() - h0)
    stream.synchronize()
    if host:
        launch_s = sorted(host)[len(host) // 2]
    else:
        h0 = time.perf_counter()
        run(0)
        launch_s = time.perf_counter() - h0
        stream.synchronize()

    starts = [cp.cuda.Event() for _ in range(repeats)]
    ends = [cp.cuda.Event() for _ in range(repeats)]
    # Enough GPU busy time to cover enqueueing every timed call, capped at half a second.
    spinner(stream, min(0.5, 1.5 * launch_s * repeats + 0.002))
    for i in range(repeats):
        starts[i].record(stream)
        run(i % n_sets)
        ends[i].record(stream)
    ends[-1].synchronize()
    times = [cp.cuda.get_elapsed_time(a, b) for a, b in zip(starts, ends)]
    return times, repeats, warmup


def free_gpu_memory(env):
    try:
        if env.cupy is not None:
            env.cupy.get_default_memory_pool().free_all_blocks()
    except Exception:  # noqa: BLE001
        pass
    try:
        if env.torch is not None:
            env.torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001
        pass


# ---------------------------------------------------------------------------------------------
# one point
# ---------------------------------------------------------------------------------------------

def run_point(env, args, impls, spinner, pt, index, l2_bytes):
    cp = env.cupy
    rec = dict(pt)
    rec["flops"] = attention_flops(pt["B"], pt["H"], pt["S"], pt["S"], pt["D"], pt["causal"])
    backward = args.pass_ == "backward"
    if backward:
        rec["flops"] *= BACKWARD_FLOP_FACTOR
    rec["scale"] = scale = 1.0 / math.sqrt(pt["D"])
    rec["impls"] = {}
    seed = args.seed * 100003 + index

    itemsize = ITEMSIZE[pt["dtype"]]
    set_bytes = (4 if backward else 3) * pt["B"] * pt["H"] * pt["S"] * pt["D"] * itemsize
    n_sets = input_sets_needed(set_bytes, l2_bytes)
    rec["input_sets"] = n_sets
    try:
        sets = make_inputs(env, pt, n_sets, seed, with_do=backward)
    except Exception as e:  # noqa: BLE001
        reason = f"n/a: inputs: {short_reason(e)}"
        for impl in impls:
            rec["impls"][impl.name] = {"status": reason}
        return rec

    checks = {}  # one CheckSet per precision mode in use, on the same slices

    def check_for(precision):
        if precision not in checks:
            try:
                if backward:
                    if env.ref is None or sets[0].cdo is None:
                        raise RuntimeError("the backward check needs cuflash.reference and CuPy")
                    checks[precision] = BackwardCheckSet(env, pt, sets[0], scale,
                                                         args.check_slices, seed)
                else:
                    checks[precision] = CheckSet(env, pt, *sets[0].any(), scale,
                                                 args.check_slices, args.check_rows, seed,
                                                 precision=precision)
                rec["check" if precision is None else f"check_{precision}"] = \
                    checks[precision].summary()
            except Exception as e:  # noqa: BLE001
                checks[precision] = None
                rec["check"] = {"error": short_reason(e)}
                log(f"    reference failed: {short_reason(e)}")
                if os.environ.get("BENCH_TRACEBACK"):
                    traceback.print_exc(file=sys.stderr)
        return checks[precision]

    for impl in impls:
        r = rec["impls"].setdefault(impl.name, {})
        why = impl.unavailable()
        if why:
            r["status"] = f"n/a: {why}"
            continue
        if isinstance(impl, CuflashImpl) and sets[0].cq is not None and not backward:
            try:
                r["kernel"] = impl.dispatch(pt, sets)
            except Exception as e:  # noqa: BLE001
                r["kernel"] = f"? ({short_reason(e)})"
        run = None
        try:
            stream = impl.stream()
            with impl.context():
                run = (impl.prepare_backward if backward else impl.prepare)(pt, sets, scale)
                # correctness first (this call also compiles / plans)
                t0 = time.perf_counter()
                out = run(0)
                stream.synchronize()
                r["first_call_s"] = round(time.perf_counter() - t0, 4)
                if backward and isinstance(impl, CuflashImpl):
                    r["kernel"] = impl.dispatch(pt, sets)
                check = check_for(impl.precision if pt["dtype"] == "float32" else None)
                if check is None:
                    r["status"] = "n/a: no reference"
                    continue
                ok, err, ratio = check.check(out)
                r["max_abs_err"] = err
                r["err_over_threshold"] = ratio
                r["err_over_bound"] = check.last_bound_ratio
                del out
                if not ok and impl.must_pass:
                    r["status"] = "FAIL"
                    continue
                if not ok:
                    impl.notes["check"] = "over the pass threshold (timed anyway: a peer)"
                times, reps, warm = time_impl(cp, run, stream, n_sets, args.warmup,
                                              args.repeats, args.time_cap, spinner)
            times_sorted = sorted(times)
            med = float(np.median(times))
            r.update({
                "status": "ok", "median_ms": med, "min_ms": times_sorted[0],
                "max_ms": times_sorted[-1], "mean_ms": float(np.mean(times)),
                "repeats": reps, "warmup": warm, "times_ms": times,
                "tflops": rec["flops"] / (med * 1e-3) / 1e12,
            })
            if impl.notes:
                r["notes"] = dict(impl.notes)
        except Skip as e:
            r["status"] = str(e)
        except Exception as e:  # noqa: BLE001 - one implementation must not stop the run
            r["status"] = "n/a: out of memory" if _is_oom(e) else f"n/a: {impl.explain(e)}"
            if os.environ.get("BENCH_TRACEBACK"):
                traceback.print_exc(file=sys.stderr)
        finally:
            run = None
            try:
                cp.cuda.Device().synchronize()
            except Exception:  # noqa: BLE001
                pass
            if isinstance(impl, CupyNaiveImpl):
                free_gpu_memory(env)
    del sets
    free_gpu_memory(env)
    return rec


# ---------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------

def cell(r):
    st = r.get("status", "n/a")
    if st == "ok":
        return f"{r['tflops']:.1f}"
    if st == "FAIL":
        return "FAIL"
    if st.startswith("skipped: memory"):
        return "skip(mem)"
    if st.startswith("skipped"):
        return "skip"
    return "n/a"


def ratios(rec, impl_names):
    """{ratio title: cuflash TFLOP/s / peer TFLOP/s or None} for the ratio columns in use."""
    out = {}
    if "cuflash" not in impl_names:
        return out
    mine = rec["impls"].get("cuflash", {})
    for peer, title in RATIO_PEERS:
        if peer not in impl_names:
            continue
        other = rec["impls"].get(peer, {})
        if mine.get("status") == "ok" and other.get("status") == "ok":
            out[title] = mine["tflops"] / other["tflops"]
        else:
            out[title] = None
    return out


def build_table(records, impl_names):
    head = ["D", "S", "B", "H", "causal", "dtype"] + [f"{n}" for n in impl_names]
    ratio_titles = [t for p, t in RATIO_PEERS if "cuflash" in impl_names and p in impl_names]
    head += ratio_titles
    rows = []
    for rec in records:
        row = [str(rec["D"]), str(rec["S"]), str(rec["B"]), str(rec["H"]),
               "1" if rec["causal"] else "0", rec["dtype"]]
        row += [cell(rec["impls"].get(n, {})) for n in impl_names]
        rs = ratios(rec, impl_names)
        row += ["-" if rs.get(t) is None else f"{rs[t]:.2f}x" for t in ratio_titles]
        rows.append(row)
    return head, rows, ratio_titles


def summarize(records, impl_names):
    """Geometric means of the ratios and the FLASH verdict."""
    summ = {"geomean": {}, "points": len(records)}
    _, _, titles = build_table(records, impl_names)
    per = {t: [] for t in titles}
    for rec in records:
        for t, v in ratios(rec, impl_names).items():
            if v is not None:
                per[t].append(v)
    for t in titles:
        summ["geomean"][t] = {"value": geomean(per[t]), "points": len(per[t])}

    verdict = None
    if "cuflash" in impl_names and "torch-flash" in impl_names:
        below, below_r, cuflash_bad, not_compared, compared = [], [], [], [], 0
        for rec in records:
            tag = (f"D={rec['D']} S={rec['S']} causal={int(rec['causal'])} {rec['dtype']}")
            mine = rec["impls"].get("cuflash", {})
            flash = rec["impls"].get("torch-flash", {})
            if flash.get("status") != "ok":
                not_compared.append(tag)
                continue
            if mine.get("status") != "ok":
                cuflash_bad.append(f"{tag} ({mine.get('status', 'n/a')})")
                continue
            compared += 1
            r = mine["tflops"] / flash["tflops"]
            if r < 1.0:
                below.append(f"{tag} ({r:.2f}x)")
                below_r.append((r, below[-1]))
        ok = not below and not cuflash_bad and compared > 0
        if ok:
            text = f"YES at all {compared} compared point(s)"
        elif compared == 0 and not cuflash_bad:
            text = "NOT EVALUATED: FLASH ran at no point"
        else:
            parts = []
            if below:
                worst = sorted(below_r)[:4]
                parts.append(f"below 1.0x at {len(below)} of {compared} compared point(s), "
                             f"worst: " + "; ".join(t for _, t in worst)
                             + ("; ..." if len(below) > len(worst) else ""))
            if cuflash_bad:
                parts.append(f"cuflash did not run or pass at {len(cuflash_bad)} point(s): "
                             + _fmt_points(cuflash_bad, 4, "; "))
            text = "NO: " + " | ".join(parts)
        if not_compared:
            text += (f" [{len(not_compared)} point(s) without a FLASH result: "
                     + _fmt_points(not_compared, 4, "; ") + "]")
        verdict = {"holds": ok, "text": text, "compared": compared, "below": below,
                   "cuflash_not_ok": cuflash_bad, "not_compared": not_compared}
    else:
        verdict = {"holds": None,
                   "text": "NOT EVALUATED: needs both cuflash and torch-flash in --impl"}
    summ["flash_verdict"] = verdict
    return summ


def collect_notes(records, impl_names):
    """Distinct non-numeric outcomes (n/a reasons, skips) with the points they occurred at."""
    notes = {}
    kernels = {}
    for rec in records:
        tag = f"D={rec['D']} S={rec['S']} c={int(rec['causal'])} {rec['dtype']}"
        for n in impl_names:
            r = rec["impls"].get(n, {})
            st = r.get("status", "n/a")
            if st != "ok":
                key = (n, st if st != "FAIL" else
                       f"FAIL (max abs err {r.get('max_abs_err', float('nan')):.3g}, "
                       f"{r.get('err_over_threshold', float('nan')):.3g}x the threshold)")
                notes.setdefault(key, []).append(tag)
            if n.startswith("cuflash") and r.get("kernel"):
                kernels.setdefault((n, r["kernel"]), []).append(tag)
            for k, v in (r.get("notes") or {}).items():
                notes.setdefault((n, f"{k} {v}"), []).append(tag)
    return notes, kernels


def _fmt_points(tags, limit=6, sep=", "):
    if len(tags) <= limit:
        return sep.join(tags)
    return sep.join(tags[:limit]) + f"{sep}... ({len(tags)} points)"


def header_lines(h):
    gpu = h.get("gpu", "?")
    extra = []
    if h.get("compute_capability"):
        extra.append(f"sm_{h['compute_capability'].replace('.', '')}")
    if h.get("gpu_memory_gib"):
        extra.append(f"{h['gpu_memory_gib']} GiB")
    if h.get("sm_count"):
        extra.append(f"{h['sm_count']} SMs")
    if h.get("l2_cache_mib"):
        extra.append(f"L2 {h['l2_cache_mib']} MiB")
    lines = [
        ("date", h.get("date_utc")),
        ("GPU", gpu + (f" ({', '.join(extra)})" if extra else "")),
        ("driver", f"{h.get('driver') or '?'} (CUDA driver API {h.get('cuda_driver_api')})"),
        ("CUDA runtime", h.get("cuda_runtime")),
        ("NVRTC", h.get("nvrtc")),
        ("Python", h.get("python")),
        ("CuPy", h.get("cupy")),
        ("torch", h.get("torch") + (f" (CUDA {h.get('torch_cuda')}, cuDNN {h.get('cudnn')})"
                                     if h.get("torch_cuda") else "")),
        ("numpy / scipy", f"{h.get('numpy')} / {h.get('scipy')}"),
        ("cuflash", f"{h.get('cuflash')}" + (f" (git {h['git_commit']})"
                                              if h.get("git_commit") else "")),
        ("reference", h.get("reference")),
        ("command", h.get("command")),
    ]
    st = h.get("settings", {})
    lines.append(("settings", f"B*S={st.get('tokens_B_times_S')}, H*D={st.get('width_H_times_D')}, "
                              f"layout (B,H,S,D), warmup {st.get('warmup')}, repeats "
                              f"{st.get('repeats')}, median of CUDA-event times, "
                              f"{st.get('check_slices')} checked (b,h) slices x "
                              f"{st.get('check_rows') or 'all'} rows"))
    return lines


def render_text(h, records, impl_names, summ, notes, kernels):
    out = ["cuflash attention benchmark"]
    lines = header_lines(h)
    w = max(len(k) for k, _ in lines)
    out += [f"  {k.ljust(w)} : {v}" for k, v in lines]
    out.append("")
    if h.get("settings", {}).get("pass") == "backward":
        out.append("BACKWARD pass (dq, dk, dv): TFLOP/s (flops = 2.5 * 4*B*H*S*S*D, halved when "
                   "causal; median time)")
    else:
        out.append("TFLOP/s (flops = 4*B*H*S*S*D, halved when causal; median time)")
    head, rows, titles = build_table(records, impl_names)
    widths = [max(len(head[i]), *(len(r[i]) for r in rows)) if rows else len(head[i])
              for i in range(len(head))]
    fmt = lambda r: "  ".join(c.rjust(widths[i]) for i, c in enumerate(r))  # noqa: E731
    out.append(fmt(head))
    out.append("  ".join("-" * x for x in widths))
    out += [fmt(r) for r in rows]
    if kernels:
        out.append("")
        out.append("cuflash kernels:")
        for (n, k), tags in kernels.items():
            out.append(f"  {n}: {k} at {_fmt_points(tags)}")
    if notes:
        out.append("")
        out.append("notes:")
        for (n, st), tags in notes.items():
            out.append(f"  {n}: {st} at {_fmt_points(tags)}")
    out.append("")
    for t in titles:
        g = summ["geomean"][t]
        val = "-" if g["value"] is None else f"{g['value']:.3f}x"
        out.append(f"geomean {t}: {val} over {g['points']} point(s)")
    out.append(f"cuflash >= 1.0x FLASH at every point: {summ['flash_verdict']['text']}")
    return "\n".join(out)


def _md_escape(s):
    return str(s).replace("|", "\\|")


def render_markdown(h, records, impl_names, summ, notes, kernels):
    out = ["## cuflash attention benchmark", ""]
    for k, v in header_lines(h):
        if k == "command":
            out.append(f"- {k}: `{v}`")
        else:
            out.append(f"- {k}: {_md_escape(v)}")
    out.append("")
    if h.get("settings", {}).get("pass") == "backward":
        out.append("**Backward pass** (dq, dk, dv; flops = 2.5 x the forward's).")
    out.append("TFLOP/s per implementation (flops = 4·B·H·S·S·D, halved when causal; median of "
               "CUDA-event timings). FAIL = wrong result, not timed; n/a = raised or unsupported "
               "(see notes); skip(mem) = cupy-naive would need too much memory.")
    out.append("")
    head, rows, titles = build_table(records, impl_names)
    out.append("| " + " | ".join(head) + " |")
    out.append("|" + "|".join("---:" for _ in head) + "|")
    out += ["| " + " | ".join(_md_escape(c) for c in r) + " |" for r in rows]
    out.append("")
    for t in titles:
        g = summ["geomean"][t]
        val = "-" if g["value"] is None else f"{g['value']:.3f}x"
        out.append(f"- geomean {t}: **{val}** over {g['points']} point(s)")
    out.append(f"- cuflash >= 1.0x FLASH at every point: "
               f"{_md_escape(summ['flash_verdict']['text'])}")
    if kernels:
        out.append("")
        out.append("cuflash kernels:")
        out.append("")
        for (n, k), tags in kernels.items():
            out.append(f"- {n}: `{k}` at {_md_escape(_fmt_points(tags))}")
    if notes:
        out.append("")
        out.append("Notes:")
        out.append("")
        for (n, st), tags in notes.items():
            out.append(f"- {n}: {_md_escape(st)} at {_md_escape(_fmt_points(tags))}")
    out.append("")
    return "\n".join(out)


def _json_safe(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {str(k): _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    if isinstance(x, (np.floating,)):
        return _json_safe(float(x))
    if isinstance(x, (np.integer,)):
        return int(x)
    return x


def write_outputs(args, h, records, impl_names, complete):
    summ = summarize(records, impl_names)
    notes, kernels = collect_notes(records, impl_names)
    print(render_text(h, records, impl_names, summ, notes, kernels), flush=True)
    if not complete:
        print(f"(interrupted: {len(records)} point(s) measured)", flush=True)
    if args.markdown:
        try:
            with open(args.markdown, "w") as f:
                f.write(render_markdown(h, records, impl_names, summ, notes, kernels))
            log(f"wrote {args.markdown}")
        except OSError as e:
            log(f"could not write {args.markdown}: {e}")
    if args.json:
        doc = {"header": h, "impls": list(impl_names), "complete": complete,
               "flops_formula": ("2.5 * " if args.pass_ == "backward" else "")
               + "4*B*H*Sq*Sk*D, halved when causal",
               "points": records, "summary": summ,
               "notes": [{"impl": n, "status": st, "points": tags}
                         for (n, st), tags in notes.items()]}
        try:
            with open(args.json, "w") as f:
                json.dump(_json_safe(doc), f, indent=1)
            log(f"wrote {args.json}")
        except OSError as e:
            log(f"could not write {args.json}: {e}")
    return summ


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------

def main(argv=None):
    args = parse_args(argv)
    env = Env()
    header = collect_header(env, args)
    impl_names = list(args.impl)
    if env.cupy is None:
        log(f"CuPy with a GPU is required for timing: {env.cupy_err}")
        return 2
    if env.torch is None:
        log(f"torch not importable ({env.torch_err}): skipping the torch SDPA backends; inputs "
            f"come from cupy.random")
    if env.cuflash is None:
        log(f"cuflash not importable ({env.cuflash_err}): cuflash columns will read n/a")
    if env.ref is None:
        log(f"cuflash.reference not importable ({env.ref_err}): using the built-in float64 "
            f"reference and tolerance")

    try:
        l2 = int(env.cupy.cuda.Device().attributes.get("L2CacheSize", 0)) or FALLBACK_L2_BYTES
    except Exception:  # noqa: BLE001
        l2 = FALLBACK_L2_BYTES
    spinner = Spinner(env.cupy)
    if spinner.err:
        log(f"spin kernel unavailable ({spinner.err}); host launch overhead may leak into "
            f"short timings")
        header["spin_kernel"] = f"unavailable: {spinner.err}"
    impls = make_impls(env, args)
    points = build_points(args)
    log(f"{len(points)} point(s) x {len(impls)} implementation(s): {', '.join(impl_names)}")

    records, complete = [], True
    t_start = time.perf_counter()
    try:
        for i, pt in enumerate(points):
            t0 = time.perf_counter()
            tag = (f"[{i + 1}/{len(points)}] D={pt['D']} S={pt['S']} B={pt['B']} H={pt['H']} "
                   f"causal={int(pt['causal'])} {pt['dtype']}")
            log(tag + " ...")
            try:
                rec = run_point(env, args, impls, spinner, pt, i, l2)
            except Exception as e:  # noqa: BLE001 - never lose the run to one point
                rec = dict(pt, flops=attention_flops(pt["B"], pt["H"], pt["S"], pt["S"],
                                                     pt["D"], pt["causal"]),
                           impls={n: {"status": f"n/a: {short_reason(e)}"} for n in impl_names})
                free_gpu_memory(env)
            rec["wall_s"] = round(time.perf_counter() - t0, 2)
            records.append(rec)
            parts = []
            for n in impl_names:
                r = rec["impls"].get(n, {})
                parts.append(f"{n} {cell(r)}")
                if n == "cuflash" and r.get("kernel"):
                    parts[-1] += f" [{r['kernel']}]"
            log(f"    {' | '.join(parts)}  ({rec['wall_s']:.1f} s)")
    except KeyboardInterrupt:
        complete = False
        log("interrupted: reporting the points measured so far")
    header["total_wall_s"] = round(time.perf_counter() - t_start, 1)
    write_outputs(args, header, records, impl_names, complete)
    return 0 if complete else 130


if __name__ == "__main__":
    sys.exit(main())
