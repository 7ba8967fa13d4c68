"""Dispatch: which kernel, with which template arguments, for these inputs on this device.

The rule, in order:

1. ``kernel="generic"`` forces the generic kernel (``kernels_cu/attn_generic.cu``): scalar
   float32 (float64 for float64 inputs) arithmetic with the accurate exp2, every dtype, head dims
   1..256. It is the audit path.
2. ``kernel="tensorcore"`` asks for the mma.sync tensor-core kernel (``kernels_cu/attn_mma.cu``,
   sm_80+, float16/bfloat16) and raises if the inputs do not qualify; ``kernel="hopper"`` does the
   same for the Hopper kernel (``kernels_cu/attn_wgmma.cu``: TMA, wgmma, warp specialisation).
3. ``kernel="auto"`` takes the Hopper kernel when the inputs qualify (see `hopper_reason`:
   compute capability exactly 9.0, float16/bfloat16, D == Dv, D % 8 == 0, 64 <= D <= 256, rows
   and batch strides 16-byte aligned, no batch axis running backwards), else the tensor-core
   kernel when they qualify (see `tensorcore_reason`: compute capability >= 8.0, the same dtypes
   and alignment, any D % 8 == 0), else the generic kernel. Head dims between the fast paths
   are zero-padded to the next one.

Kernel sources mirror the tile constants below (`GenericConfig` and friends); a mismatch leaves
rows unwritten, which the GPU tests catch by poisoning every output with NaN.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Optional

from ._compile import Specialisation

_CXX_TYPE = {"float16": "cuflash::fp16_t", "bfloat16": "cuflash::bf16_t", "float32": "float",
             "float64": "double"}
_ACC_TYPE = {"float16": "float", "bfloat16": "float", "float32": "float", "float64": "double"}
_ACC_BYTES = {"float": 4, "double": 8}


@dataclass(frozen=True)
class Plan:
    """A kernel launch plan: what to compile and how to launch it."""

    label: str             # human-readable, e.g. "generic<float16,D64,Dv64,causal>"
    spec: Specialisation
    block_m: int           # query rows per block
    block_n: int           # keys per K/V tile (the Hopper kernel's tensor-map boxes use it)
    threads: int           # threads per block
    smem_bytes: int        # dynamic shared memory per block
    persistent: bool = False  # launch at most one block per SM; each loops over work items
    pairs: bool = False    # a block's work item is a pair of query blocks (attn_wgmma.cu: WorkWalk)
    presplit_dpad: int = 0  # > 0: reads K, V split once per call at this padded head dim
    #                         (HOPPER_F32_PRESPLIT; _launch.presplit_kv)


def head_dim_bucket(n: int, buckets=(32, 64, 128, 256)) -> int:
    """Smallest of `buckets` that holds a head dim of n (smaller head dims are zero-padded)."""
    for b in sorted(buckets):
        if n <= b:
            return b
    raise ValueError(f"head dim {n} exceeds {max(buckets)}")


def generic_plan(dtype_name: str, d: int, dv: int, causal: bool) -> Plan:
    """The generic kernel for (dtype, D, Dv, causal): GenericConfig in attn_generic.cu.

    One bucket serves both head dims (the larger one's), which halves the number of
    specialisations at the price of idle lanes when D and Dv differ a lot.
    """
    db = dvb = head_dim_bucket(max(d, dv))
    t, acc = _CXX_TYPE[dtype_name], _ACC_TYPE[dtype_name]
    nwarps, rows, bc = 4, 4, 32
    block_m = nwarps * rows
    smem_elems = block_m * (db + 1) + bc * (db + 1) + bc * dvb
    name = (f"cuflash::cuflash_fwd_generic<{t}, {acc}, {db}, {dvb}, "
            f"{'true' if causal else 'false'}>")
    label = f"generic<{dtype_name},D{db},{'causal' if causal else 'full'}>"
    return Plan(label=label, spec=Specialisation("attn_generic", name), block_m=block_m,
                block_n=bc, threads=nwarps * 32, smem_bytes=smem_elems * _ACC_BYTES[acc])


#: Tensor-core tile shapes per padded head dim: (BN keys per tile, warps per block, m16 tiles per
#: warp MT, min blocks per SM for __launch_bounds__, stage O through shared memory).
#: BM = 16 * MT * warps query rows per block. See kernels_cu/attn_mma.cu and notes/PERF.md: on an
#: H200 the staged epilogue changed speed by -1% to +6% at S = 512-2048 (gains mostly at S = 512),
#: and at D = 64 one m-tile per warp with 4 blocks per SM gained another 1-13%
#: (benchmarks/tune.py --kernel tensorcore, 2026-11-30). D = 128 takes 48-key tiles on sm_90 too
#: since the scan and scalar P.V of non-finite V on masked tiles (attn_mma.cu:
#: pv_visible_keys) came in: at 64 keys its causal form spilled 8 bytes (NVRTC 13.0, 2026-12-01).
TC_CONFIGS = {
    64: (64, 4, 1, 4, True),
    96: (64, 4, 2, 2, True),
    128: (48, 4, 2, 2, True),
    192: (64, 4, 1, 2, True),
    256: (64, 4, 1, 2, True),
}
#: Per-architecture exceptions, {first compute capability: {dpad: config}}, applied when the
#: device's compute capability is below the next key: on sm_8x the 64-key tiles of D = 96/128
#: leave no register headroom (NVRTC 13.0 spills 8 bytes for sm_80), so they take 48-key tiles.
TC_ARCH_CONFIGS = {
    80: {96: (48, 4, 2, 2, True), 128: (48, 4, 2, 2, True)},
    90: {},
}
TC_DTYPES = ("float16", "bfloat16", "float32")
#: float32 through TF32 products (attn_mma.cu, T = float): tile shapes per (padded head dim,
#: precision), in the format of TC_CONFIGS. Shared memory holds float32 Q, K and V tiles as they
#: are (4 bytes an element, rows padded by 16 or 4 words against bank conflicts): D = 128 with
#: BN = 32 is 91 KiB, two blocks per SM on Hopper. Registers set the key tile width: the split form
#: ("highest") keeps, beside O's D / 2 accumulators per thread, the scores' small products and the
#: per-tile P.V accumulators; at BN = 64 it spilled from D = 96 on (NVRTC 13, sm_90), D = 128
#: spilled on sm_80 with the staged epilogue, D = 192 spilled at BN = 32 and, once the scalar P.V
#: of non-finite V on masked tiles came in, at BN = 16 too, and at D = 256, where O alone takes 128
#: registers, every tile shape spilled. So 3xTF32 "highest" stops at D = 128 (larger head dims: the
#: 3xfp16 form, TC_F16SPLIT_CONFIGS, or the generic kernel; see tensorcore_reason).
TC_F32_CONFIGS = {
    (32, "highest"): (64, 4, 1, 2, True),
    (64, "highest"): (64, 4, 1, 2, True),
    (96, "highest"): (32, 4, 1, 2, True),
    (128, "highest"): (32, 4, 1, 2, False),
    (32, "high"): (64, 4, 1, 2, True),
    (64, "high"): (64, 4, 1, 2, True),
    (96, "high"): (64, 4, 1, 2, True),
    (128, "high"): (64, 4, 1, 2, True),
    (192, "high"): (32, 4, 1, 2, True),
    (256, "high"): (32, 4, 1, 1, True),
}


#: float32 exceptions for sm_8x (applied below compute capability 9.0), in the format of
#: TC_F32_CONFIGS; None: no tensor-core form there (the generic kernel runs). NVRTC 13.0, the
#: oldest the cuda13 extra allows, spilled 124-768 bytes for sm_80 with the staged epilogue at
#: D = 64 ("highest"), 128 and 256 ("high"), and for every tile shape of D = 128 "highest"
#: (2026-12-01; NVRTC 13.5 compiled them without spills). Not run on an sm_8x GPU.
TC_F32_ARCH_CONFIGS = {
    80: {(64, "highest"): (64, 4, 1, 2, False), (128, "highest"): None,
         (128, "high"): (64, 4, 1, 2, False), (256, "high"): (64, 4, 1, 1, False)},
    90: {},
}


#: float32 "highest" on the mma.sync kernel in the fp16-split form (attn_mma.cu, OP = fp16_t,
#: "3xfp16"; notes/FLOAT32.md, "mma.sync 3xfp16"): each tile scaled by a power of two and split
#: into fp16 hi + lo in place in shared memory (float32 rows of D + 4 words), three m16n8k16 fp16
#: products per multiply-add. {padded head dim: tiles}, in the format of TC_CONFIGS.
#: D = 192 and 256 (head dims 129..256; notes/FLOAT32.md, "mma.sync 3xfp16 at D = 192 and 256"):
#: O takes 96 / 128 registers a thread, so 32 / 16 keys a tile (ptxas 234-255 registers, no
#: spills with NVRTC 13.0 and 13.5); 98 KiB of shared memory, two blocks an SM. Under
#: kernel="auto" only with F32_D256_AUTO.
TC_F16SPLIT_CONFIGS = {
    32: (64, 4, 1, 2, True),
    64: (64, 4, 1, 2, True),
    96: (32, 4, 1, 2, True),
    128: (32, 4, 1, 2, False),
    192: (32, 4, 1, 2, True),
    256: (16, 4, 1, 2, True),
}
#: Whether kernel="auto" takes the mma.sync 3xfp16 form at head dims above 128 (the 192 and 256
#: entries of TC_F16SPLIT_CONFIGS), where float32 "highest" otherwise runs the generic kernel.
#: On since the H200 run of 2026-12-02 (session f): tests/test_gpu_float32.py passed through it
#: (kernel="tensorcore"), 1.41-1.77x torch EFFICIENT at D = 192/256 against the generic
#: kernel's 0.13-0.17x, at an error at most EFFICIENT's (benchmarks/RESULTS.md, "session f").
F32_D256_AUTO = True
#: The form float32 takes on the mma.sync kernel where it is not F32_TERMS' TF32 one: "highest"
#: takes 3xfp16; {} gives the 3xTF32 form (TC_F32_CONFIGS) back (benchmarks/bench.py:
#: cuflash-tc-3xtf32). Replace the dict rather than edit it: the call cache (_callcache) notices
#: a new dict.
TC_F32_FORM = {"highest": "3xfp16"}


def tc_f32_form(precision: str) -> str:
    """The mma.sync float32 form `precision` takes: "3xfp16", "3xtf32" or "tf32"."""
    return TC_F32_FORM.get(precision, F32_TERMS[precision][1])


def _f32_config(dpad: int, precision: str, compute_capability: int, form: Optional[str] = None):
    if (form or tc_f32_form(precision)) == "3xfp16":
        return TC_F16SPLIT_CONFIGS.get(dpad) if precision == "highest" else None
    arch = max((a for a in TC_F32_ARCH_CONFIGS if a <= compute_capability), default=None)
    if arch is not None and (dpad, precision) in TC_F32_ARCH_CONFIGS[arch]:
        return TC_F32_ARCH_CONFIGS[arch][(dpad, precision)]
    return TC_F32_CONFIGS.get((dpad, precision))


def f32_head_dims(precision: str, compute_capability: int = 90, form: Optional[str] = None):
    """Padded head dims of the float32 tensor-core kernel in this precision mode (in `form`, by
    default the one TC_F32_FORM gives it) on a device of this compute capability."""
    if (form or tc_f32_form(precision)) == "3xfp16":
        return sorted(TC_F16SPLIT_CONFIGS) if precision == "highest" else []
    return sorted(dp for dp, mode in TC_F32_CONFIGS
                  if mode == precision
                  and _f32_config(dp, mode, compute_capability, form) is not None)


#: Precision modes of float32 inputs (the `precision=` argument): the number of tensor-core
#: products per multiply-add (TERMS in attn_mma.cu) and the name the plan's label carries.
#: "highest": float32-accurate split-precision products (3 TF32 products, common.cuh: Tf32Split);
#: "high": one TF32 product (operands rounded to 10 mantissa bits).
F32_TERMS = {"highest": (3, "3xtf32"), "high": (1, "tf32")}


def _arch_config(table, arch_table, key, compute_capability):
    """table[key], or the exception arch_table[a][key] of the newest architecture a <= the
    device's compute capability that has one."""
    arch = max((a for a in arch_table if a <= compute_capability), default=None)
    if arch is not None and key in arch_table[arch]:
        return arch_table[arch][key]
    return table[key]


def tensorcore_config(dpad: int, compute_capability: int, dtype_name: str = "float16",
                      precision: str = "highest", form: Optional[str] = None):
    """(BN, warps, MT, min blocks per SM, staged O) for a padded head dim on a device."""
    if dtype_name == "float32":
        return _f32_config(dpad, precision, compute_capability, form)
    return _arch_config(TC_CONFIGS, TC_ARCH_CONFIGS, dpad, compute_capability)


def tensorcore_plan(dtype_name: str, d: int, causal: bool, compute_capability: int,
                    precision: str = "highest", config=None, form: Optional[str] = None) -> Plan:
    """The mma.sync kernel for these inputs. float32 takes the form TC_F32_FORM gives
    `precision` ("3xfp16": TC_F16SPLIT_CONFIGS) or `form` ("3xfp16", or F32_TERMS' mode of
    `precision`: "3xtf32" or "tf32", the TF32 form with the products of F32_TERMS,
    TC_F32_CONFIGS); 16-bit dtypes ignore both (their products are exact in float32).
    ``config``: a function of (dpad, plain config) giving the tile config to use instead (the
    variants' plans, cuflash/_dispatch_variants.py)."""
    f32 = dtype_name == "float32"
    form = (form or tc_f32_form(precision)) if f32 else None
    f16split = form == "3xfp16"
    if f32 and not f16split and form != F32_TERMS[precision][1]:
        raise ValueError(f"precision={precision!r} has no tensor-core float32 form {form!r}")
    if f16split and precision != "highest":
        raise ValueError(f"the 3xfp16 form is precision='highest' only (got {precision!r})")
    dpad = head_dim_bucket(d, f32_head_dims(precision, compute_capability, form) if f32
                           else TC_CONFIGS)
    bn, nwarps, mt, minb, stage_o = tensorcore_config(dpad, compute_capability, dtype_name,
                                                      precision, form)
    if config is not None:
        bn, nwarps, mt, minb, stage_o = config(dpad, (bn, nwarps, mt, minb, stage_o))
    terms, mode = (3, "3xfp16") if f16split else F32_TERMS[precision] if f32 else (1, None)
    bm = 16 * mt * nwarps
    if f16split:  # MmaConfig: every tile D + 4 words a row, 2 words a warp for the reductions
        smem = (bm + 2 * bn) * (dpad + 4) * 4 + 2 * nwarps * 4
    elif f32:
        smem = ((bm + bn) * (dpad + 16) + bn * (dpad + 4)) * 4  # MmaConfig: SQK, SV
    else:
        smem = (bm + 2 * bn) * (dpad + 8) * 2
    cxx_bool = {True: "true", False: "false"}
    name = (f"cuflash::cuflash_fwd_mma<{_CXX_TYPE[dtype_name]}, {terms}, {dpad}, {bn}, {nwarps}, "
            f"{mt}, {minb}, {cxx_bool[bool(stage_o)]}, {cxx_bool[bool(causal)]}"
            f"{', cuflash::fp16_t' if f16split else ''}>")
    label = (f"tensorcore<{dtype_name},{mode + ',' if mode else ''}D{dpad},BM{bm},BN{bn},"
             f"{'stagedO,' if stage_o else ''}{'causal' if causal else 'full'}>")
    return Plan(label=label, spec=Specialisation("attn_mma", name), block_m=bm, block_n=bn,
                threads=32 * nwarps, smem_bytes=smem)


#: Shared memory one block may opt in to, bytes, by the first compute capability it applies to
#: (CUDA C Programming Guide, "Technical Specifications per Compute Capability"): 8.0 and 8.7
#: 163 KiB, 8.6 and 8.9 99 KiB, 9.0 227 KiB. The launch checks read the device's own value
#: (MaxSharedMemoryPerBlockOptin); the dispatcher reads this table so that kernel="auto" never
#: picks tiles the device cannot hold (`smem_reason`), and the tests check every arch table
#: against it (tests/test_arch_limits_cpu.py).
SMEM_OPTIN_BYTES = {80: 163 * 1024, 86: 99 * 1024, 87: 163 * 1024, 89: 99 * 1024,
                    90: 227 * 1024}


def smem_optin_bytes(compute_capability: Optional[int]) -> Optional[int]:
    """SMEM_OPTIN_BYTES for a compute capability (that of the newest listed one at or below
    it; None below 8.0 or without one)."""
    if compute_capability is None:
        return None
    arch = max((a for a in SMEM_OPTIN_BYTES if a <= compute_capability), default=None)
    return None if arch is None else SMEM_OPTIN_BYTES[arch]


def smem_reason(plan: Plan, compute_capability: Optional[int], static: int = 0) -> Optional[str]:
    """Why `plan` (with `static` bytes of static shared memory beside its dynamic ones) does not
    fit one block's shared memory on this compute capability, or None (also when unknown)."""
    limit = smem_optin_bytes(compute_capability)
    need = plan.smem_bytes + static
    if limit is None or need <= limit:
        return None
    return (f"its tiles ({plan.label}) need {need} bytes of shared memory per block; compute "
            f"capability {compute_capability} allows {limit}")


def _aligned16(x) -> bool:
    """Data pointer and every stride of x (a CuPy array) are multiples of 16 bytes."""
    if x.data.ptr % 16:
        return False
    return all(st % 16 == 0 for n, st in zip(x.shape[:-1], x.strides[:-1]) if n > 1)


def _sm80_reason(prob, compute_capability: Optional[int], dtypes) -> Optional[str]:
    """The checks every mma.sync kernel shares: GPU inputs, sm_80+, one of `dtypes`, D == Dv."""
    if getattr(prob, "backend", "gpu") != "gpu":
        return "the inputs are on the CPU"
    if compute_capability is None or compute_capability < 80:
        return f"it needs compute capability 8.0 or newer (this GPU: {compute_capability})"
    if prob.dtype_name not in dtypes:
        names = ", ".join(dtypes[:-1]) + (" and " if len(dtypes) > 1 else "") + dtypes[-1]
        return f"it takes {names} inputs, not {prob.dtype_name}"
    if prob.d != prob.dv:
        return f"it needs D == Dv (got D={prob.d}, Dv={prob.dv})"
    return None


def tensorcore_reason(prob, compute_capability: Optional[int]) -> Optional[str]:
    """Why the tensor-core kernel cannot run these inputs, or None if it can."""
    why = _sm80_reason(prob, compute_capability, TC_DTYPES)
    if why is not None:
        return why
    multiple = 4 if prob.dtype_name == "float32" else 8  # 16-byte rows
    if prob.d % multiple:
        return (f"it needs a head dim that is a multiple of {multiple} for {prob.dtype_name} "
                f"(got {prob.d})")
    f32_dims = f32_head_dims(prob.precision, compute_capability)
    if prob.dtype_name == "float32" and (not f32_dims or prob.d > max(f32_dims)):
        return (f"its float32 form with precision={prob.precision!r} takes head dims up to "
                f"{max(f32_dims) if f32_dims else 0} on compute capability "
                f"{compute_capability} (got {prob.d}): the accumulators of larger ones do not "
                "fit in registers")
    if not prob.scale > 0:
        return f"it folds a positive scale into exp2 (got scale={prob.scale})"
    bufs = [prob.q, prob.k, prob.v] + ([prob.out] if prob.out is not None else [])
    if not all(_aligned16(x) for x in bufs):
        return "every row of q, k, v (and out) must start on a 16-byte boundary"
    return None


class HopperTiles(NamedTuple):
    """Template arguments of the Hopper kernel for one padded head dim (attn_wgmma.cu)."""

    bn: int          # keys per K/V tile
    stages: int      # K/V pipeline stages in shared memory
    q_stages: int    # Q buffers: 2 lets the producer load the next item's Q during this one
    consumers: int   # consumer warpgroups of 64 query rows each: BM = 64 * consumers
    overlap: bool    # the softmax of tile j runs under P_{j-1} V_{j-1} inside a warpgroup
    pingpong: bool   # the consumers take turns to issue their products (named barriers)
    # the two consumers share 64 query rows, each owning half the head dim (attn_wgmma.cu:
    # WgmmaConfig::HSPLIT, which the kernel derives from 3xfp16 at DPAD = 256: this field only
    # tells the host, it is not a template argument)
    hsplit: bool = False
    # O leaves through shared memory by bulk copies the consumers wait for only before they stage
    # the next item's O (attn_wgmma.cu: cuflash_fwd_wgmma_ao; 16-bit, plain policy, dense only)
    async_o: bool = False

    @property
    def bm(self) -> int:
        return 64 if self.hsplit else 64 * self.consumers

    def o_stage_bytes(self, dpad: int) -> int:
        """Shared memory of the async O epilogue (attn_wgmma.cu: ASYNC_O): 16 rows of 2 dpad +
        64 bytes per consumer warp, and 128 bytes of alignment; 0 without it."""
        return 128 + 4 * self.consumers * 16 * (2 * dpad + 64) if self.async_o else 0

    def smem_bytes(self, dpad: int, itemsize: int = 2, terms: int = 1,
                   f16split: bool = False) -> int:
        """Dynamic shared memory (attn_wgmma.cu: WgmmaConfig::SMEM). float32 (itemsize 4): hi
        and, for terms = 3, lo copies of the Q, K and V^T tiles, one V staging tile, and the
        "landed" barriers. f16split (the 3xfp16 form): the float32 tiles, rewritten in place as
        fp16 hi and lo panels, the barriers and the tiles' exponents."""
        if f16split:
            bars = 8 * (3 * self.q_stages + 6 * self.stages)
            exps = (4 * (self.q_stages + 2 * self.stages + 4) + 7) // 8 * 8
            xch = 8 + 2 * 64 * self.bn * 4 if self.hsplit else 0  # WgmmaConfig::XCH_BYTES
            return (1024 + 4 * dpad * (self.q_stages * self.bm + 2 * self.stages * self.bn)
                    + bars + exps + xch)
        split = 2 if terms == 3 else 1
        f32 = itemsize == 4
        return (self.o_stage_bytes(dpad) + 1024 + split * (self.q_stages * self.bm * dpad * itemsize
                                + 2 * self.stages * self.bn * dpad * itemsize)
                + (self.bn * dpad * itemsize if f32 else 0)
                + 8 * (2 * self.q_stages + 4 * self.stages
                       + (self.q_stages + 2 * self.stages if f32 else 0)))


#: Hopper kernel launch choices, {(padded head dim, causal, long keys): (tiles, persistent)},
#: where "long keys" is Sk > HOPPER_LONG_SK. Persistent: one block per SM loops over the work
#: items, so the producer loads the next item while the consumers finish the current one (causal
#: items are pairs of query blocks of equal total length, attn_wgmma.cu: WorkWalk, so the static
#: round-robin stays balanced). Shared memory (16-bit Q, K, V): D = 64 BM = 192 89 KiB,
#: D = 128 BN = 128 161 KiB, BN = 176 209 KiB, D = 256 BN = 80 225 KiB (of 227 KiB per block).
#:
#: Chosen on an H200 (benchmarks/tune.py --kernel hopper --s 512,1024,2048,8192, float16,
#: 2026-11-30, two runs; TFLOP/s with cuDNN's in the same run in brackets):
#: - ping-pong between the consumers gained 4-12% at D = 128 (S = 1024: 516 -> 566 [603],
#:   S = 2048: 560 -> 615 [640]; causal S = 2048: 479 -> 537 [514]), ~0-2% at D = 64 and 256;
#: - D = 64: three consumers (BM = 192) with the overlapped softmax gained 8-19% without the mask
#:   (S = 2048: 428 -> 501 [471]); under the causal mask BM = 192 wastes more of the diagonal
#:   tiles and lost 4-29% up to S = 2048 (S = 1024: 316 -> 283 [345]) but gained 13% at 8192;
#: - D = 128, long keys: BN = 176 one block per item 655 [646] against BN = 128 persistent 629;
#: - D = 256: BN = 80 beat BN = 64 by 0-14% from S = 1024 on (S = 2048: 681 vs 646 [684]);
#: - two Q buffers (the next item's Q loaded during this one) gained nothing (+0.3% to -4%).
#: Revisited after the 16-byte epilogue stores and per-warpgroup causal tile counts (tune.py
#: --d 64 --s 512,1024 --repeats 15, 2026-11-30 07:06 UTC): at D = 64 under the mask the
#: overlapped softmax now edges out the plain one (S = 512: 248 vs 245 [267]; S = 1024: 321 vs
#: 318 [343]), BN = 64 loses 10-13% and three consumers still lose 6-25% there.
HOPPER_LONG_SK = 2048
HOPPER_DTYPES = ("float16", "bfloat16")
# Every entry overlaps the softmax and takes turns; they differ in tile width and consumers.
_C2 = HopperTiles(bn=128, stages=2, q_stages=1, consumers=2, overlap=True, pingpong=True)
_C3 = _C2._replace(consumers=3)  # BM = 192
_N176 = _C2._replace(bn=176)
_N80 = _C2._replace(bn=80)
HOPPER_TABLE = {
    (64, False, False): (_C3, True),
    (64, False, True): (_C3, True),
    (64, True, False): (_C2, True),
    (64, True, True): (_C3, True),
    (128, False, False): (_C2, True),
    (128, False, True): (_N176, False),
    (128, True, False): (_C2, True),
    (128, True, True): (_C2, True),
    (256, False, False): (_N80, True),
    (256, False, True): (_N80, False),
    (256, True, False): (_N80, True),
    (256, True, True): (_N80, True),
}


#: The float32 form of the Hopper kernel (notes/FLOAT32.md, "Hopper wgmma form"): TF32 wgmma
#: with TERMS products per multiply-add (F32_TERMS), {(padded head dim, precision): tiles}, one
#: block per SM, persistent. Shared memory (float32 Q, K, V^T, with lo copies for "highest", and
#: one V staging tile): D = 64 "high" BN = 128 193 KiB, D = 128 "high" BN = 64 225 KiB,
#: D = 64 "highest" BN = 64 209 KiB, D = 128 "highest" BN = 32 one stage 209 KiB. Not tuned on a
#: GPU yet (chosen by the counts in the note).
_F32_C2 = HopperTiles(bn=64, stages=2, q_stages=1, consumers=2, overlap=True, pingpong=True)
HOPPER_F32_TABLE = {
    (64, "high"): _F32_C2._replace(bn=128),
    (128, "high"): _F32_C2,
    (64, "highest"): _F32_C2._replace(overlap=False),
    (128, "highest"): _F32_C2._replace(bn=32, stages=1, overlap=False),
}


#: The fp16-split form of float32 "highest" (notes/FLOAT32.md, "fp16 split"): each float32 tile
#: as fp16 hi + lo parts of x * 2^e (one power of two per tile), three fp16 wgmma products per
#: multiply-add at twice the TF32 rate, V N-major as in the 16-bit kernel. {padded head dim:
#: tiles}, one block per SM, persistent. Shared memory (the float32 tiles, rewritten in place):
#: D = 64 BN = 64 three stages 132 KiB, D = 128 BN = 64 two stages 193 KiB. BN = 64 and no
#: overlapped softmax from the consumers' registers (S, its small products and two promoted
#: steps: 4 x BN / 2; O and one tile's P V: 2 x D / 2). H200: its GPU tests passed, 70-108
#: TFLOP/s (benchmarks/RESULTS.md, "run 4").
HOPPER_F16SPLIT_TABLE = {
    64: _F32_C2._replace(stages=3, overlap=False),
    128: _F32_C2._replace(overlap=False),
}
#: The 3xfp16 form at D = 129..256 (DPAD = 256; notes/FLOAT32.md, "Hopper 3xfp16 at D = 256"):
#: two consumers on the same 64 rows, each owning 128 head-dim columns, their partial scores added
#: through shared memory; one stage of BN = 64 (230504 B of shared memory). Taken (by
#: kernel="hopper", and by "auto" where HOPPER_F32_AUTO takes the Hopper float32 form) only while
#: HOPPER_F32_D256 is on (on since the H200 run of 2026-12-02, session g call 3: its GPU tests
#: passed; auto takes it from D = HOPPER_F32_D256_AUTO_MIN_D).
HOPPER_F16SPLIT_D256 = {256: _F32_C2._replace(stages=1, overlap=False, pingpong=False, hsplit=True)}
HOPPER_F32_D256 = True
#: Under kernel="auto", float32 at 128 < D < HOPPER_F32_D256_AUTO_MIN_D keeps the mma.sync form
#: (its D = 192 tiles); only D >= this takes the head-dim split form (zero-padded to 256). The
#: H200 measured the split form at D = 256 only (benchmarks/RESULTS.md, "session g, call 3":
#: 62.5-73.3 TFLOP/s against the mma.sync form's 54.2-70.8); its notes predict no gain at D = 192.
HOPPER_F32_D256_AUTO_MIN_D = 193


def hopper_f16split_table() -> dict:
    """{padded head dim: HopperTiles} of the Hopper 3xfp16 form: HOPPER_F16SPLIT_TABLE, and
    HOPPER_F16SPLIT_D256 while HOPPER_F32_D256 is on."""
    if HOPPER_F32_D256:
        return {**HOPPER_F16SPLIT_TABLE, **HOPPER_F16SPLIT_D256}
    return HOPPER_F16SPLIT_TABLE
#: The float32 form each precision takes on Hopper where it is not F32_TERMS' TF32 one: "highest"
#: takes 3xfp16; {"highest": "3xtf32"} (or {}) selects the 3xTF32 form (HOPPER_F32_TABLE) again
#: (benchmarks/bench.py: cuflash-hopper-3xtf32). Replace the dict rather than edit it: the call
#: cache (_callcache) notices a new dict.
HOPPER_F32_FORM = {"highest": "3xfp16"}


def hopper_f32_form(precision: str) -> str:
    """The Hopper float32 form `precision` takes: "3xfp16", "3xtf32" or "tf32"."""
    return HOPPER_F32_FORM.get(precision, F32_TERMS[precision][1])


def hopper_f32_head_dims(precision: str, form: Optional[str] = None):
    """The padded head dims of the Hopper float32 form of `precision` (`form`: as
    HOPPER_F32_FORM chooses)."""
    form = form or (hopper_f32_form(precision) if precision in F32_TERMS else None)
    if form == "3xfp16":
        return set(hopper_f16split_table())
    return {dp for dp, mode in HOPPER_F32_TABLE if mode == precision}


#: Whether the plain 16-bit Hopper forward sends O out through shared memory and bulk copies
#: (HopperTiles.async_o, attn_wgmma.cu: cuflash_fwd_wgmma_ao) wherever the staging rows fit
#: (hopper_async_o_fits): issue 13's small problems, where an item has one or two key tiles and
#: its epilogue sits on the consumers' path (notes/PERF.md, "h5"). On since session n
#: (2026-12-04): on the H200 the Hopper forward's 366 16-bit GPU tests passed with it (session k:
#: its own 158), the small problems ran 0.4-5% faster, the forward grid's D = 128 points 0.3-2%
#: and D = 64 without causal 1-2%, D = 64 causal at S = 1k and 4k 0.8% slower (twice);
#: benchmarks/RESULTS.md "session n". False restores the direct stores. The variants' and varlen
#: twins keep the direct stores.
HOPPER_ASYNC_O = True


def hopper_async_o_fits(cfg: HopperTiles, dpad: int) -> bool:
    """Whether `cfg` with the async O epilogue fits one block's shared memory (227 KiB):
    D = 64 and 128 at BN = 128, not D = 128 at BN = 176 nor D = 256."""
    return (not cfg.hsplit and cfg._replace(async_o=True).smem_bytes(dpad)
            <= SMEM_OPTIN_BYTES[90])


#: What the wider query block of three consumers (BM = 192) gains per useful row over two
#: (BM = 128). Measured on the H200 (2026-12-02, benchmarks/RESULTS.md "session e, call 2":
#: tune.py --shapes, D = 64 without the mask), C3 / C2 times the rows-used ratio: 1.28 at
#: Sq = 197, 1.31 at 256, 1.19 at 512, 1.23 at 577, 1.24 at 1024. 1.25 picks the faster of the
#: two at all five (1.15 took BM = 128 at Sq = 577, 2.6% slower).
HOPPER_C3_GAIN = 1.25


def _row_use(sq: int, bm: int) -> float:
    """The fraction of a kernel's query rows that are real rows: Sq over the padded Sq."""
    return sq / (-(-sq // bm) * bm)


def hopper_choice(dpad: int, causal: bool, sk: int, sq: Optional[int] = None):
    """(HopperTiles, persistent) for a padded head dim, mask, key count and, if given, query
    count (16-bit inputs). Three consumers (BM = 192) give way to two (BM = 128) when the last
    query block would be so empty that the wider block's gain is lost: ViT's Sq = 197 pads to
    384 rows at BM = 192 (51% used) and to 256 at BM = 128 (77%)."""
    cfg, persistent = HOPPER_TABLE[(dpad, bool(causal), sk > HOPPER_LONG_SK)]
    if sq is not None and cfg.consumers == 3:
        c2 = cfg._replace(consumers=2)
        if _row_use(sq, cfg.bm) * HOPPER_C3_GAIN < _row_use(sq, c2.bm):
            cfg = c2
    return cfg, persistent


#: The 3xfp16 Hopper forward with K and V split once per call (attn_wgmma.cu: cuflash_split16_kv,
#: OP = cuflash::fp16pre_t; notes/FLOAT32.md, "Where the 3xfp16 Hopper forward waits"): ncu on
#: the H100 (session r) put 40-54% of the consumers' stall samples in the waits for the producer's
#: per-tile split, which repeats for every query block that visits a tile. The plain forward only
#: (variants and the varlen twin keep the in-place split). Label `presplit`; the split K and V,
#: two (..., Sk, 2 DPAD + 64) float16 arrays (about K's and V's size again), live in the caller's
#: `workspace=` (attention_workspace_size counts them) or else in a block of CuPy's pool on the
#: call's stream (`_launch.presplit_kv`). On since session u (2026-12-07): with it on (and
#: MIN_REUSE 0) the float32 GPU suites passed on an H100 (test_gpu_float32 583, the float32 cases
#: of test_gpu / test_nonfinite 129, workspace, call cache, JAX and its command buffers 117),
#: bitwise equal to the in-place form; the H200 grid of session t measured it at 3.13x torch
#: EFFICIENT on the geometric mean (in-place 2.11x). False restores the split per tile.
HOPPER_F32_PRESPLIT = True

#: Where HOPPER_F32_PRESPLIT pays: the split pass (one read and one write of K and V) is repaid by
#: the query blocks that visit each key tile (`presplit_reuse`: ceil(Sq / BM), halved under the
#: causal mask). Measured on the H200 (session t, 2026-12-06, the float32 grid): at S = 512 causal
#: (a reuse of 2 at BM = 128) the in-place form was as fast at D = 64 (60.2 against 59.6 TFLOP/s)
#: and 18% faster at D = 128 (72.8 against 61.9); at a reuse of 4 and more the pre-split form was
#: as fast or faster at every point (+3% to +100%). 0: always (the bitwise tests' tails).
HOPPER_F32_PRESPLIT_MIN_REUSE = 3


def presplit_reuse(block_m: int, sq: Optional[int], causal: bool) -> float:
    """How many query blocks visit a key tile, on average (`HOPPER_F32_PRESPLIT_MIN_REUSE`);
    infinite where Sq is not known."""
    if sq is None:
        return math.inf
    n = -(-int(sq) // block_m)
    return n / 2 if causal else float(n)


def hopper_plan(dtype_name: str, d: int, causal: bool, sk: int,
                precision: str = "highest", form: Optional[str] = None,
                sq: Optional[int] = None, choose=None, f16split_table=None,
                presplit: bool = False) -> Plan:
    """The Hopper kernel for these inputs; float32 takes the form HOPPER_F32_FORM gives
    `precision` ("3xfp16": HOPPER_F16SPLIT_TABLE; else the TF32 form with the products of
    F32_TERMS, HOPPER_F32_TABLE), or `form` ("3xfp16", or F32_TERMS' mode of `precision`: "3xtf32"
    / "tf32") where given; 16-bit dtypes ignore both. `sq` (None: not known) lets short query
    counts take narrower query blocks (hopper_choice). `choose(dpad, tiles, persistent)`, if
    given, returns the (tiles, persistent) to use instead (the variants' registers:
    _dispatch_variants.hopper_variant_plan). `f16split_table` (None: hopper_f16split_table()) is
    the 3xfp16 form's table to take the tiles from (the compile set builds D = 256 with the flag
    off)."""
    f32 = dtype_name == "float32"
    form = form or (hopper_f32_form(precision) if f32 else None)
    f16split = f32 and form == "3xfp16"
    if f16split:
        if precision != "highest":
            raise ValueError(f"the 3xfp16 form is precision='highest' only (got {precision!r})")
        table = hopper_f16split_table() if f16split_table is None else f16split_table
        dpad = head_dim_bucket(d, set(table))
        cfg, persistent = table[dpad], True
        terms, mode = 3, "3xfp16"
    elif f32:
        if form != F32_TERMS[precision][1]:
            raise ValueError(f"precision={precision!r} has no Hopper float32 form {form!r}")
        dpad = head_dim_bucket(d, hopper_f32_head_dims(precision, form))
        cfg, persistent = HOPPER_F32_TABLE[(dpad, precision)], True
        terms, mode = F32_TERMS[precision]
    else:
        dpad = head_dim_bucket(d, {key[0] for key in HOPPER_TABLE})
        cfg, persistent = hopper_choice(dpad, causal, sk, sq)
        terms, mode = 1, None
        # the async O epilogue: where the flag or the table asks for it and it fits
        cfg = cfg._replace(async_o=bool((cfg.async_o or HOPPER_ASYNC_O)
                                        and hopper_async_o_fits(cfg, dpad)))
    if f32 or choose is not None:
        cfg = cfg._replace(async_o=False)  # float32 and the twins (variants, varlen): direct stores
    if choose is not None:
        cfg, persistent = choose(dpad, cfg, persistent)
    cxx_bool = {True: "true", False: "false"}
    kernel = "cuflash_fwd_wgmma_ao" if cfg.async_o else "cuflash_fwd_wgmma"
    presplit = bool(presplit and f16split
                    and presplit_reuse(cfg.bm, sq, causal) >= HOPPER_F32_PRESPLIT_MIN_REUSE)
    op = ", cuflash::fp16pre_t" if presplit else ", cuflash::fp16_t" if f16split else ""
    name = (f"cuflash::{kernel}<{_CXX_TYPE[dtype_name]}, {terms}, {dpad}, {cfg.bn}, "
            f"{cfg.stages}, {cfg.q_stages}, {cfg.consumers}, {cxx_bool[bool(cfg.overlap)]}, "
            f"{cxx_bool[bool(cfg.pingpong)]}, {cxx_bool[bool(causal)]}{op}>")
    label = (f"hopper<{dtype_name},{mode + ',' if mode else ''}D{dpad},BM{cfg.bm},BN{cfg.bn},"
             f"S{cfg.stages},Q{cfg.q_stages},{'hsplit,' if cfg.hsplit else ''}"
             f"{'presplit,' if presplit else ''}"
             f"{'overlap,' if cfg.overlap else ''}{'pingpong,' if cfg.pingpong else ''}"
             f"{'asyncO,' if cfg.async_o else ''}"
             f"{'persistent,' if persistent else ''}{'causal' if causal else 'full'}>")
    return Plan(label=label, spec=Specialisation("attn_wgmma", name, arch="sm_90a"),
                block_m=cfg.bm, block_n=cfg.bn, threads=128 * (cfg.consumers + 1),
                smem_bytes=cfg.smem_bytes(dpad, 4 if f32 else 2, terms, f16split),
                persistent=persistent,
                pairs=bool(causal), presplit_dpad=dpad if presplit else 0)


def presplit_spec(dpad: int, bn: int) -> Specialisation:
    """The once-per-call split of K and V for a HOPPER_F32_PRESPLIT plan of padded head dim
    `dpad` and key tiles of `bn` (attn_wgmma.cu: cuflash_split16_kv; `_launch.presplit_kv`)."""
    return Specialisation("attn_wgmma", f"cuflash::cuflash_split16_kv<{dpad}, {bn}>",
                          arch="sm_90a")


def presplit_kernel_specs():
    """The split kernels of every 3xfp16 Hopper table entry (the compile set)."""
    tables = {**HOPPER_F16SPLIT_TABLE, **HOPPER_F16SPLIT_D256}
    return list(dict.fromkeys(presplit_spec(dpad, cfg.bn) for dpad, cfg in tables.items()))


def hopper_reason(prob, compute_capability: Optional[int]) -> Optional[str]:
    """Why the Hopper kernel cannot run these inputs, or None if it can."""
    if compute_capability != 90:
        return ("it is built for sm_90a and runs on compute capability 9.0 only "
                f"(this GPU: {compute_capability})")
    if prob.dtype_name not in HOPPER_DTYPES + ("float32",):
        return f"it takes float16, bfloat16 and float32 inputs, not {prob.dtype_name}"
    if prob.dtype_name == "float32":
        dims = sorted(hopper_f32_head_dims(prob.precision))
        if not dims:
            return f"its float32 form has no precision={prob.precision!r} mode"
        if not 64 <= prob.d <= max(dims) or prob.d % 8:
            return (f"its float32 form takes head dims from 64 to {max(dims)}, multiples of 8 "
                    f"(got {prob.d})")
        if prob.d != prob.dv:
            return f"it needs D == Dv (got D={prob.d}, Dv={prob.dv})"
        if getattr(prob, "backend", "gpu") != "gpu":
            return "the inputs are on the CPU"
        if not prob.scale > 0:
            return f"it folds a positive scale into exp2 (got scale={prob.scale})"
        bufs = [prob.q, prob.k, prob.v] + ([prob.out] if prob.out is not None else [])
        if not all(_aligned16(x) for x in bufs):
            return "every row of q, k, v (and out) must start on a 16-byte boundary"
    else:
        why = tensorcore_reason(prob, compute_capability)
        if why is not None:
            return why
    if prob.d < 64:
        return f"it takes head dims from 64 to 256 (got {prob.d})"
    for name, x in (("q", prob.q), ("k", prob.k), ("v", prob.v)):
        if x.shape[-2] > 1 and x.strides[-2] <= 0:
            return f"the rows of {name} must not overlap (row stride {x.strides[-2]})"
        # The tensor maps take unsigned byte strides (cuTensorMapEncodeTiled): a batch axis that
        # runs backwards (q[::-1], q[:, ::-1]) would reach the driver as 2^64 - |s|. The mma.sync
        # kernel reads such views through its signed strides, so auto takes it instead.
        back = [st for n, st in zip(x.shape[:-2], x.strides[:-2]) if n > 1 and st < 0]
        if back:
            return (f"the batch axes of {name} must not run backwards (byte strides "
                    f"{tuple(x.strides[:-2])}; the tensor maps' strides are unsigned)")
    from . import _tma

    if not _tma.available():
        return f"the CUDA driver's tensor-map API is unavailable ({_tma.unavailable_reason()})"
    return None


#: Whether kernel="auto" takes the Hopper float32 form (HOPPER_F16SPLIT_TABLE / HOPPER_F32_TABLE,
#: the form HOPPER_F32_FORM gives the precision) where it qualifies. On since the complete H200
#: run of 2026-12-02 (tree aa6468b, benchmarks/RESULTS.md "2026-12-02"): with the flag on, the
#: float32 cases of tests/test_gpu.py, test_backward_gpu.py and test_nonfinite.py 261 passed and
#: 2 failed, both the generic backward's dv at Sq = 1, Sk = 1000 (causal), which recomputes P
#: from q and k and so does not depend on the forward: the same two failed with the flag off in
#: the same run (notes/BACKWARD.md, "Open"); tests/test_gpu_float32.py passed whole. Set it to
#: False to have auto take the mma.sync form for float32 again.
HOPPER_F32_AUTO = True


def _f32_wide(prob) -> bool:
    """float32 inputs whose mma.sync form is the 3xfp16 one at a head dim above 128."""
    return (prob.dtype_name == "float32" and prob.d > 128
            and tc_f32_form(prob.precision) == "3xfp16")


def plan_for(prob, compute_capability: Optional[int]) -> Plan:
    """The plan for a validated `Problem` on a device of the given compute capability (e.g. 90)."""
    if getattr(prob, "variant", None) is not None:   # window, softcap, alibi, bias, mask
        from ._dispatch_variants import variant_plan_for
        return variant_plan_for(prob, compute_capability)
    if prob.kernel == "generic":
        return generic_plan(prob.dtype_name, prob.d, prob.dv, prob.causal)
    if prob.kernel in ("auto", "decode"):  # few query rows: kernels_cu/attn_decode.cu
        from . import _decode

        if prob.kernel == "decode":
            why_not = _decode.decode_reason(prob, compute_capability)
            if why_not is not None:
                raise ValueError(f"kernel='decode' cannot run these inputs: {why_not}")
        if prob.kernel == "decode" or _decode.wants_decode(prob, compute_capability):
            return _decode.decode_plan(prob.dtype_name, prob.d, prob.causal, paged=False,
                                       rows=_decode.dense_rows(prob))
    hopper_auto = prob.dtype_name != "float32" or (
        HOPPER_F32_AUTO and not 128 < prob.d < HOPPER_F32_D256_AUTO_MIN_D)
    if prob.kernel == "hopper" or (prob.kernel == "auto" and hopper_auto):
        why_not = hopper_reason(prob, compute_capability)
        if why_not is None:
            return hopper_plan(prob.dtype_name, prob.d, prob.causal, prob.sk, prob.precision,
                               sq=prob.sq, presplit=HOPPER_F32_PRESPLIT)
        if prob.kernel == "hopper":
            raise ValueError(f"kernel='hopper' cannot run these inputs: {why_not}")
    why_not = tensorcore_reason(prob, compute_capability)
    if why_not is None and prob.kernel == "auto" and not F32_D256_AUTO and _f32_wide(prob):
        why_not = "F32_D256_AUTO is off"  # auto keeps the generic kernel above D = 128
    if why_not is None:
        plan = tensorcore_plan(prob.dtype_name, prob.d, prob.causal, compute_capability,
                               prob.precision)
        why_not = smem_reason(plan, compute_capability)  # float32 TF32 tiles on 99-KiB parts
        if why_not is None:
            return plan
    if prob.kernel == "tensorcore":
        raise ValueError(f"kernel='tensorcore' cannot run these inputs: {why_not}")
    return generic_plan(prob.dtype_name, prob.d, prob.dv, prob.causal)


def all_specialisations(compute_capability: int = 90):
    """Every plan the dispatcher can return on a device of this compute capability (the compile
    check builds them for sm_80 and sm_90)."""
    plans = []
    for dt in _CXX_TYPE:
        for db in (32, 64, 128, 256):
            for causal in (False, True):
                plans.append(generic_plan(dt, db, db, causal))
    for dt in TC_DTYPES:
        modes = F32_TERMS if dt == "float32" else ("highest",)
        for precision in modes:
            # float32: the form TC_F32_FORM gives the mode, and the TF32 one (selectable)
            forms = ({tc_f32_form(precision), F32_TERMS[precision][1]} if dt == "float32"
                     else {None})
            for form in sorted(forms, key=str):
                for dpad in (f32_head_dims(precision, compute_capability, form)
                             if dt == "float32" else TC_CONFIGS):
                    for causal in (False, True):
                        plans.append(tensorcore_plan(dt, dpad, causal, compute_capability,
                                                     precision, form=form))
    if compute_capability == 90:
        for dt in HOPPER_DTYPES:
            for dpad, causal, long_keys in HOPPER_TABLE:
                for sq in (None, 1):  # 1: the narrower block short query counts take
                    plan = hopper_plan(dt, dpad, causal, HOPPER_LONG_SK + long_keys, sq=sq)
                    if plan not in plans:
                        plans.append(plan)
        for dpad, precision in HOPPER_F32_TABLE:  # the TF32 forms (3xTF32 stays selectable)
            for causal in (False, True):
                plans.append(hopper_plan("float32", dpad, causal, 1024, precision,
                                         form=F32_TERMS[precision][1]))
        f16split = {**HOPPER_F16SPLIT_TABLE, **HOPPER_F16SPLIT_D256}  # D = 256 with the flag off too
        for dpad in f16split:
            for causal in (False, True):
                for presplit in (False, True):   # HOPPER_F32_PRESPLIT on or off
                    plans.append(hopper_plan("float32", dpad, causal, 1024, "highest",
                                             form="3xfp16", f16split_table=f16split,
                                             presplit=presplit))
    return plans


# ---------------------------------------------------------------------------------------------
# Backward pass (notes/BACKWARD.md). A backward call runs a short sequence of kernels sharing one
# parameter block (kernels_cu/common.cuh: BwdParams): the preprocess (delta = rowsum(do * o), and
# zeroing the float32 dq accumulator when one is used), then the plan's passes in order.

#: Grid mappings of the backward passes (cuflash/_launch.py: launch_backward):
#: "rows": ceil(Sq / block_m) query blocks x the q owners (batch entries over the axes q does not
#: broadcast along), the query block fastest; "keys": ceil(Sk / block_n) key blocks x the k/v
#: owners; "dq_convert": ceil(Sq / 8) row blocks x the q owners.
BWD_GRIDS = ("rows", "keys", "dq_convert")
#: Rows per block of cuflash_bwd_preprocess and cuflash_bwd_convert_dq (attn_bwd_prep.cu).
BWD_PREP_ROWS = 8


@dataclass(frozen=True)
class BackwardPlan:
    """The kernels of one backward call: the preprocess, then `passes` in order.

    ``passes`` is a tuple of (grid mapping, Plan) with the grid mapping one of `BWD_GRIDS`.
    ``dq_accum_row`` > 0: the plan accumulates dq in a float32 workspace with rows of that many
    elements (>= D), zeroed by the preprocess; 0: it writes dq directly.
    ``deterministic``: no pass uses order-dependent float atomics.
    ``lse_acc``: the "rows" pass recomputes each row's softmax max m and sum l in the
    accumulator type into a workspace (BwdParams.lse_acc: m, then l) that the "keys" pass reads,
    so it must come first.
    """

    label: str
    preprocess: Plan
    passes: tuple
    dq_accum_row: int = 0
    deterministic: bool = True
    lse_acc: bool = False

    @property
    def block_m(self) -> int:
        """Query rows per block of the query-parallel pass (BwdParams.n_mblocks), 1 if none."""
        return next((p.block_m for g, p in self.passes if g == "rows"), 1)

    @property
    def block_n(self) -> int:
        """Keys per block of the key-parallel pass (BwdParams.n_nblocks), 1 if none."""
        return next((p.block_n for g, p in self.passes if g == "keys"), 1)


def bwd_preprocess_plan(dtype_name: str) -> Plan:
    t, acc = _CXX_TYPE[dtype_name], _ACC_TYPE[dtype_name]
    return Plan(label=f"bwd_preprocess<{dtype_name}>",
                spec=Specialisation("attn_bwd_prep", f"cuflash::cuflash_bwd_preprocess<{t}, {acc}>"),
                block_m=BWD_PREP_ROWS, block_n=1, threads=32 * BWD_PREP_ROWS, smem_bytes=0)


def bwd_convert_dq_plan(dtype_name: str) -> Plan:
    """dq = scale * dq_accum (float32) for plans that accumulate dq with atomics."""
    return Plan(label=f"bwd_convert_dq<{dtype_name}>",
                spec=Specialisation("attn_bwd_prep",
                                    f"cuflash::cuflash_bwd_convert_dq<{_CXX_TYPE[dtype_name]}>"),
                block_m=BWD_PREP_ROWS, block_n=1, threads=32 * BWD_PREP_ROWS, smem_bytes=0)


def bwd_generic_config(dtype_name: str, db: int, dvb: int):
    """(warps, rows per warp) of BwdGenericConfig (attn_bwd_generic.cu)."""
    wide = _ACC_BYTES[_ACC_TYPE[dtype_name]] == 8 and max(db, dvb) > 128
    return (2, 2) if wide else (4, 4)


def bwd_generic_plan(dtype_name: str, d: int, dv: int, causal: bool) -> BackwardPlan:
    """The generic backward for (dtype, D, Dv, causal): a query-parallel dq pass and a
    key-parallel dk/dv pass (attn_bwd_generic.cu), both free of atomics, so deterministic. For
    float32 and float64 the dq pass recomputes each row's softmax max and sum (p = exp(s - m) / l,
    as accurate as a softmax; exp(s - lse) with the forward's float32 lse is not) for both."""
    db = dvb = head_dim_bucket(max(d, dv))
    t, acc = _CXX_TYPE[dtype_name], _ACC_TYPE[dtype_name]
    nwarps, rows = bwd_generic_config(dtype_name, db, dvb)
    block, bc = nwarps * rows, 32
    smem = ((block + bc) * ((db + 1) + (dvb + 1)) + 3 * bc) * _ACC_BYTES[acc]
    targs = f"{t}, {acc}, {db}, {dvb}, {'true' if causal else 'false'}"
    mask = "causal" if causal else "full"
    dq = Plan(label=f"bwd_dq_generic<{dtype_name},D{db},{mask}>",
              spec=Specialisation("attn_bwd_generic", f"cuflash::cuflash_bwd_dq_generic<{targs}>"),
              block_m=block, block_n=bc, threads=nwarps * 32, smem_bytes=smem)
    dkdv = Plan(label=f"bwd_dkdv_generic<{dtype_name},D{db},{mask}>",
                spec=Specialisation("attn_bwd_generic",
                                    f"cuflash::cuflash_bwd_dkdv_generic<{targs}>"),
                block_m=bc, block_n=block, threads=nwarps * 32, smem_bytes=smem)
    return BackwardPlan(label=f"generic-bwd<{dtype_name},D{db},{mask}>",
                        preprocess=bwd_preprocess_plan(dtype_name),
                        passes=(("rows", dq), ("keys", dkdv)), dq_accum_row=0,
                        deterministic=True, lse_acc=dtype_name in ("float32", "float64"))


#: Tensor-core backward tiles per padded head dim (kernels_cu/attn_bwd_mma.cu: BwdMmaConfig):
#: (BM query rows per tile, warps per block (BN = 16 * warps keys), Q/dO stages, min blocks per
#: SM[, OPT]): an optional fifth entry is the kernel's OPT bits (TC_BWD_OPTS; 0 when absent).
#: Both head dims take 8 warps (BN = 128 keys) and OPT = lean + late ("late" applies to the
#: deterministic mode only): the H200 run of 2026-12-01 (benchmarks/RESULTS.md, "night",
#: bwd_tune.py) measured +8-18% for lean over the earlier (64, 4, 2, 2) / (32, 8, 2, 1) forms, and
#: 8 warps at D = 64 the same default speed with a cheaper deterministic mode.
#: Shared memory: D = 64 91 KiB, D = 128 113 KiB (two stages; an A100 allows 163 KiB, an H200
#: 227 KiB).
TC_BWD_CONFIGS = {
    64: (64, 8, 2, 1, 3),
    128: (32, 8, 2, 1, 3),
}
#: Per-architecture exceptions, {first compute capability: {dpad: config}}, applied when the
#: device's compute capability is below the next key: sm_86 / sm_89 allow 99 KiB of shared memory
#: per block, so D = 128 takes 64-key blocks and one Q/dO stage (78 KiB).
TC_BWD_ARCH_CONFIGS = {
    80: {},
    86: {128: (32, 4, 1, 1, 3)},
    90: {},
}
TC_BWD_DTYPES = ("float16", "bfloat16")
#: OPT bits of cuflash_bwd_mma (attn_bwd_mma.cu: BWD_OPT_LEAN, BWD_OPT_LATE): "lean" per-tile
#: bookkeeping without divisions, deferred lse/delta stores and an unmasked exp2 path; "late"
#: deterministic hand-over after the next barrier. Same results, bit for bit.
TC_BWD_OPTS = {"lean": 1, "late": 2}
#: Speed candidates of the tensor-core backward, not yet measured (notes/BACKWARD.md "Speed
#: candidates"): name -> {dpad: config}, the form of TC_BWD_CONFIGS. Only benchmarks
#: (benchmarks/bwd_tune.py) and tests put them in place of the defaults; the compile check
#: builds every one (bwd_candidate_plans).
TC_BWD_CANDIDATES = {
    "base": {64: (64, 4, 2, 2), 128: (32, 8, 2, 1)},
    "lean": {64: (64, 4, 2, 2, 1), 128: (32, 8, 2, 1, 1)},
    "late": {64: (64, 4, 2, 2, 2), 128: (32, 8, 2, 1, 2)},
    "lean+late": {64: (64, 4, 2, 2, 3), 128: (32, 8, 2, 1, 3)},
    "w8": {64: (64, 8, 2, 1)},
    "w8+lean": {64: (64, 8, 2, 1, 1)},
    "w8+lean+late": {64: (64, 8, 2, 1, 3)},
}
#: Padding columns of a dq accumulator row past DPAD (the turn counters of deterministic mode sit
#: at column DPAD of each query tile's first row). 16 makes every row a multiple of 64 bytes
#: (DPAD is a multiple of 64), so a quad's 32-byte (mma.sync, red.v2) or 64-byte (Hopper, red.v4)
#: reduction covers whole 32-byte sectors of one 128-byte line; with 4 (rows of 16 mod 32 bytes)
#: every other row's pieces straddled two sectors, 1.5x the sectors at L2 (ncu, H100, session y:
#: notes/BACKWARD.md, "The dq reductions").
TC_BWD_DQ_PAD = 16


def bwd_tensorcore_config(dpad: int, compute_capability: int):
    """(BM, warps, stages, min blocks per SM, OPT) of the tensor-core backward on a device."""
    cfg = tuple(_arch_config(TC_BWD_CONFIGS, TC_BWD_ARCH_CONFIGS, dpad, compute_capability))
    return cfg + (0,) * (5 - len(cfg))


def bwd_tensorcore_smem(dpad: int, bm: int, nwarps: int, stages: int, f32: bool = False) -> int:
    """Shared-memory bytes of cuflash_bwd_mma (BwdMmaConfig::SMEM_BYTES); ``f32``: the float32
    form (float32 rows of dpad + 4 words, dS^T as hi and lo 16-bit tiles, 1 / l per row, the
    split's reduction words and dS^T exponents)."""
    bn, sd = 16 * nwarps, dpad + (4 if f32 else 8)
    elems = 2 * bn * sd + 2 * stages * bm * sd + bn * (bm + 8)
    if f32:
        return elems * 4 + stages * 3 * bm * 4 + 6 * nwarps * 4
    return elems * 2 + stages * 2 * bm * 4


#: The float32 form of the tensor-core backward (attn_bwd_mma.cu: cuflash_bwd_mma<float, ...,
#: OP = fp16_t>, "3xfp16": every product as three fp16 products of per-tile-scaled hi / lo splits,
#: notes/BACKWARD.md "float32 on the tensor cores"), tiles per padded head dim in
#: TC_BWD_CONFIGS' form: D <= 64 only, BM = 32 (BM = 64 spilled: 255 registers), 4 warps
#: (BN = 64), one Q/dO stage, two blocks per SM (62 KiB of shared memory each). D = 128 (BM = 32,
#: 110 KiB) spilled 60-300 bytes in every specialisation under NVRTC 13.0 (255 registers: the dK
#: and dV accumulators alone take 128), so it is not offered (notes/BACKWARD.md). Not yet run on
#: a GPU.
TC_BWD_F16SPLIT_CONFIGS = {
    64: (32, 4, 1, 2, 0),
}
#: Per-architecture exceptions (TC_BWD_ARCH_CONFIGS' form); none needed at D = 64.
TC_BWD_F16SPLIT_ARCH_CONFIGS = {
    80: {},
    86: {},
    90: {},
}
#: Its "rows" pass (cuflash_bwd_stats_mma: each row's m, l and delta on the tensor cores, for
#: P = exp(s - m) / l instead of the forward's float32 lse): (warps (16 query rows each), keys per
#: tile, min blocks per SM) per padded head dim; shared memory (32 warps + 2 keys) (dpad + 4)
#: floats: D = 64 68 KiB.
TC_BWD_STATS_CONFIGS = {
    64: (4, 64, 2),
}
TC_BWD_STATS_ARCH_CONFIGS = {
    80: {},
    86: {},
    90: {},
}
#: Whether kernel="auto" takes the float32 tensor-core backward where it qualifies
#: (`bwd_tensorcore_f32_reason`, Sq >= TC_BWD_F32_MIN_SQ). On since the H200 run of 2026-12-02
#: (session f): its GPU tests passed (kernel="tensorcore"), 1.03-1.07x torch EFFICIENT's float32
#: backward at D = 64 against the generic backward's 0.09x (benchmarks/RESULTS.md, "session f").
TC_BWD_F32_AUTO = True
#: The float32 tensor-core backward takes no fewer query rows than this: the split products
#: carry ~22-bit operands (hi + lo), and short rows exceed the float32 rule (the CPU model,
#: tests/f32_bwd_tc_model.py: Sq = 1 fails it on 5-9% of draws, Sq = 16 on 1 of 40, Sq = 32 on
#: none of 40; notes/BACKWARD.md "float32 on the tensor cores"). kernel="auto" keeps the generic
#: backward below it; kernel="tensorcore" raises ValueError saying so (a result outside the rule
#: is never returned silently).
TC_BWD_F32_MIN_SQ = 64


def bwd_stats_smem(dpad: int, nwarps: int, bn: int) -> int:
    """Shared-memory bytes of cuflash_bwd_stats_mma (BwdStatsConfig::SMEM_BYTES)."""
    return (2 * 16 * nwarps + 2 * bn) * (dpad + 4) * 4 + 4 * nwarps * 4


def bwd_tensorcore_f32_plan(d: int, causal: bool, deterministic: bool,
                            compute_capability: int) -> BackwardPlan:
    """The float32 tensor-core backward ("3xfp16", precision "highest" and "high" alike): the
    preprocess, the "rows" pass that recomputes each row's max, sum and delta on the tensor cores
    (lse_acc), the key-parallel cuflash_bwd_mma<float, ..., fp16_t> (dq in the float32
    accumulator: atomics, or with `deterministic` the turn counters) and the dq conversion."""
    dpad = head_dim_bucket(d, TC_BWD_F16SPLIT_CONFIGS)
    cfg = tuple(_arch_config(TC_BWD_F16SPLIT_CONFIGS, TC_BWD_F16SPLIT_ARCH_CONFIGS, dpad,
                             compute_capability))
    bm, nwarps, stages, minb, opt = cfg + (0,) * (5 - len(cfg))
    if opt & TC_BWD_OPTS["lean"]:
        raise ValueError("the float32 tensor-core backward has no 'lean' form (OPT bit 1)")
    if not deterministic:
        opt &= ~TC_BWD_OPTS["late"]
    bn = 16 * nwarps
    cxx_bool = {True: "true", False: "false"}
    mask = "causal" if causal else "full"
    name = (f"cuflash::cuflash_bwd_mma<float, {dpad}, {bm}, {bn}, {nwarps}, {stages}, {minb}, "
            f"{cxx_bool[bool(causal)]}, {cxx_bool[bool(deterministic)]}, {opt}, cuflash::fp16_t>")
    det = "det," if deterministic else ""
    det += "".join(f"{k}," for k, bit in TC_BWD_OPTS.items() if opt & bit)
    kern = Plan(label=f"bwd_mma<float32,3xfp16,D{dpad},BM{bm},BN{bn},S{stages},{det}{mask}>",
                spec=Specialisation("attn_bwd_mma", name), block_m=bm, block_n=bn,
                threads=32 * nwarps,
                smem_bytes=bwd_tensorcore_smem(dpad, bm, nwarps, stages, f32=True))
    sw, sbn, sminb = _arch_config(TC_BWD_STATS_CONFIGS, TC_BWD_STATS_ARCH_CONFIGS, dpad,
                                  compute_capability)
    stats = Plan(label=f"bwd_stats_mma<float32,3xfp16,D{dpad},BM{16 * sw},BN{sbn},{mask}>",
                 spec=Specialisation("attn_bwd_mma",
                                     f"cuflash::cuflash_bwd_stats_mma<{dpad}, {sw}, {sbn}, "
                                     f"{sminb}, {cxx_bool[bool(causal)]}>"),
                 block_m=16 * sw, block_n=sbn, threads=32 * sw,
                 smem_bytes=bwd_stats_smem(dpad, sw, sbn))
    return BackwardPlan(
        label=f"tensorcore-bwd<float32,3xfp16,D{dpad},BM{bm},BN{bn},{det}{mask}>",
        preprocess=bwd_preprocess_plan("float32"),
        passes=(("rows", stats), ("keys", kern), ("dq_convert", bwd_convert_dq_plan("float32"))),
        dq_accum_row=dpad + TC_BWD_DQ_PAD, deterministic=bool(deterministic), lse_acc=True)


def _bwd_f32_auto_reason(prob, compute_capability: Optional[int]) -> Optional[str]:
    """bwd_tensorcore_f32_reason, and the short-row limit TC_BWD_F32_MIN_SQ."""
    why = bwd_tensorcore_f32_reason(prob, compute_capability)
    sq = getattr(prob, "sq", None)
    if why is None and sq is not None and sq < TC_BWD_F32_MIN_SQ:
        return (f"its float32 form is taken for Sq >= {TC_BWD_F32_MIN_SQ} (got Sq={sq}): short "
                "rows come closest to the float32 error rule with its ~22-bit split operands")
    return why


def bwd_tensorcore_f32_reason(prob, compute_capability: Optional[int]) -> Optional[str]:
    """Why the float32 tensor-core backward cannot run these inputs, or None if it can: float32,
    sm_80+, D == Dv, D % 8 == 0, D <= 128, and the buffer conditions of the 16-bit form."""
    why = _sm80_reason(prob, compute_capability, ("float32",))
    if why is not None:
        return why
    if prob.d % 8:
        return f"its float32 form needs a head dim that is a multiple of 8 (got {prob.d})"
    if prob.d > max(TC_BWD_F16SPLIT_CONFIGS):
        return (f"its float32 form takes head dims up to {max(TC_BWD_F16SPLIT_CONFIGS)} "
                f"(got {prob.d})")
    return _bwd_buffers_reason(prob)


def bwd_tensorcore_plan(dtype_name: str, d: int, causal: bool, deterministic: bool,
                        compute_capability: int, config=None) -> BackwardPlan:
    """The mma.sync backward (attn_bwd_mma.cu): one key-parallel kernel that accumulates dq in
    float32 (atomics; with `deterministic`, in key-block order through turn counters), then the
    dq conversion. ``config``: a function of (dpad, plain config) giving the tiles to use
    instead (the variants' plans, cuflash/_dispatch_variants.py)."""
    dpad = head_dim_bucket(d, TC_BWD_CONFIGS)
    bm, nwarps, stages, minb, opt = bwd_tensorcore_config(dpad, compute_capability)
    if config is not None:
        cfg = tuple(config(dpad, (bm, nwarps, stages, minb, opt)))
        bm, nwarps, stages, minb, opt = cfg + (0,) * (5 - len(cfg))
    if not deterministic:
        opt &= ~TC_BWD_OPTS["late"]  # a deterministic hand-over only
    bn = 16 * nwarps
    cxx_bool = {True: "true", False: "false"}
    mask = "causal" if causal else "full"
    name = (f"cuflash::cuflash_bwd_mma<{_CXX_TYPE[dtype_name]}, {dpad}, {bm}, {bn}, {nwarps}, "
            f"{stages}, {minb}, {cxx_bool[bool(causal)]}, {cxx_bool[bool(deterministic)]}, "
            f"{opt}>")
    det = "det," if deterministic else ""
    det += "".join(f"{k}," for k, bit in TC_BWD_OPTS.items() if opt & bit)
    kern = Plan(label=f"bwd_mma<{dtype_name},D{dpad},BM{bm},BN{bn},S{stages},{det}{mask}>",
                spec=Specialisation("attn_bwd_mma", name), block_m=bm, block_n=bn,
                threads=32 * nwarps, smem_bytes=bwd_tensorcore_smem(dpad, bm, nwarps, stages))
    return BackwardPlan(
        label=f"tensorcore-bwd<{dtype_name},D{dpad},BM{bm},BN{bn},{det}{mask}>",
        preprocess=bwd_preprocess_plan(dtype_name),
        passes=(("keys", kern), ("dq_convert", bwd_convert_dq_plan(dtype_name))),
        dq_accum_row=dpad + TC_BWD_DQ_PAD, deterministic=bool(deterministic), lse_acc=False)


def bwd_tensorcore_reason(prob, compute_capability: Optional[int],
                          max_d: Optional[int] = None) -> Optional[str]:
    """Why the tensor-core backward cannot run these inputs, or None if it can (``max_d``: the
    largest head dim, TC_BWD_CONFIGS' by default; the Hopper backward passes its own)."""
    why = _sm80_reason(prob, compute_capability, TC_BWD_DTYPES)
    if why is not None:
        return why
    if prob.d % 8:
        return f"it needs a head dim that is a multiple of 8 (got {prob.d})"
    if max_d is None and prob.d > max(TC_BWD_CONFIGS):
        return (f"it takes head dims up to {max(TC_BWD_CONFIGS)} (got {prob.d}): the dk and dv "
                "accumulators of larger ones do not fit in registers")
    if max_d is not None and prob.d > max_d:
        return f"the Hopper backward takes head dims up to {max_d} (got {prob.d})"
    return _bwd_buffers_reason(prob)


def _bwd_buffers_reason(prob) -> Optional[str]:
    """The tensor-core backwards' conditions on the buffers (deterministic mode, alignment)."""
    q = getattr(prob, "q", None)
    if q is None:  # a bare description (tests): nothing more to check
        return None
    if prob.deterministic and math.prod(q.shape[:-2]) != math.prod(prob.batch_shape):
        return ("deterministic=True with a broadcast q: several k/v batch entries add into one "
                "dq row, which its turn counters do not order")
    bufs = [prob.q, prob.k, prob.v, prob.do]
    if prob.out_grads is not None:
        bufs += list(prob.out_grads[1:])
    if not all(_aligned16(x) for x in bufs):
        return "every row of q, k, v, do (and of the dk, dv buffers) must start on a 16-byte boundary"
    return None


#: Hopper backward tiles per padded head dim (kernels_cu/attn_bwd_wgmma.cu: BwdWgmmaConfig):
#: (BM query rows per tile, BN keys per block = 64 per consumer warpgroup; D = 256: two
#: warpgroups share BN = 64 keys, splitting the head dim of dK, dV, dQ and the queries of S^T,
#: dP^T: notes/BACKWARD.md, "D = 256"). Shared memory: D = 64 131 KiB, D = 128 146 KiB (K, V,
#: two Q and dO stages, dS^T, lse and delta), D = 256 218 KiB (also P^T and a second dS layout).
HOPPER_BWD_CONFIGS = {
    64: (128, 128),
    128: (64, 128),
    256: (64, 64),
}
HOPPER_BWD_DTYPES = ("float16", "bfloat16")
#: The Hopper backward's dS layout for dQ = dS K (kernel template argument DS_KMAJOR): True
#: stores dS K-major (only operand forms the forward runs on the GPU: two 16-bit stores per
#: pair of scores), False stores dS^T and reads it M-major (half the stores; an operand form
#: nothing else uses). Tests and benchmarks flip it to measure the other.
HOPPER_BWD_DS_KMAJOR = True
#: The D = 256 (SPLIT) form's overlapped schedule (kernel template argument OV, label "ov,"):
#: the same products in another order, dV under dS^T and the dq atomics under dK
#: (notes/BACKWARD.md, "D = 256: the overlapped schedule"). Off: on the H200 (2026-12-02, session
#: f) it ran bitwise the plain schedule's results at 0.98-1.02x its speed (predicted +12-30%);
#: tests and benchmarks (cuflash-hopper-ov) turn it on to measure it.
HOPPER_BWD_OVERLAP = False
#: Whether kernel="auto" takes the Hopper backward on compute capability 9.0 where it qualifies.
#: On since its GPU tests passed on the H200 (2026-12-01: every kernel="hopper" case of
#: tests/test_backward_gpu.py, 98 passed), where it measured 1.01-1.19x torch's FLASH backward
#: against the mma.sync backward's 0.68-0.78x (benchmarks/RESULTS.md).
HOPPER_BWD_AUTO = True


def bwd_hopper_threads(dpad: int, bn: int) -> int:
    """Threads of cuflash_bwd_wgmma (BwdWgmmaConfig::THREADS): a warpgroup per 64 keys, or two
    sharing the keys at D > 128 (SPLIT)."""
    return 256 if dpad > 128 else 128 * (bn // 64)


def bwd_hopper_smem(dpad: int, bm: int, bn: int, ds_kmajor: bool = True) -> int:
    """Shared-memory bytes of cuflash_bwd_wgmma (BwdWgmmaConfig::SMEM): K, V, two stages of Q
    and dO, dS (D > 128: also P^T, and dS^T beside a K-major dS), lse and delta, and 16 bytes
    for the deterministic mode's pending turn hand-over."""
    score_tiles = 1 + (dpad > 128) * (1 + bool(ds_kmajor))
    return (1024 + 2 * bn * dpad * 2 + 2 * 2 * bm * dpad * 2 + score_tiles * bn * bm * 2
            + 2 * 2 * bm * 4 + 16)


def bwd_hopper_plan(dtype_name: str, d: int, causal: bool, deterministic: bool) -> BackwardPlan:
    """The Hopper backward (attn_bwd_wgmma.cu, sm_90a): one key-parallel wgmma kernel that
    accumulates dq in float32 (atomics; with `deterministic`, in key-block order through the
    turn counters), then the dq conversion. The same plan model as `bwd_tensorcore_plan`."""
    dpad = head_dim_bucket(d, HOPPER_BWD_CONFIGS)
    bm, bn = HOPPER_BWD_CONFIGS[dpad]
    cxx_bool = {True: "true", False: "false"}
    mask = "causal" if causal else "full"
    kmajor = bool(HOPPER_BWD_DS_KMAJOR)
    overlap = bool(HOPPER_BWD_OVERLAP) and dpad > 128  # the SPLIT form's schedule
    name = (f"cuflash::cuflash_bwd_wgmma<{_CXX_TYPE[dtype_name]}, {dpad}, {bm}, {bn}, "
            f"{cxx_bool[bool(causal)]}, {cxx_bool[bool(deterministic)]}, {cxx_bool[kmajor]}, "
            "cuflash::PlainVariant" + (", true>" if overlap else ">"))
    det = ("det," if deterministic else "") + ("" if kmajor else "dsT,") + ("ov," if overlap else "")
    kern = Plan(label=f"bwd_wgmma<{dtype_name},D{dpad},BM{bm},BN{bn},{det}{mask}>",
                spec=Specialisation("attn_bwd_wgmma", name, arch="sm_90a"), block_m=bm,
                block_n=bn, threads=bwd_hopper_threads(dpad, bn),
                smem_bytes=bwd_hopper_smem(dpad, bm, bn, kmajor))
    return BackwardPlan(
        label=f"hopper-bwd<{dtype_name},D{dpad},BM{bm},BN{bn},{det}{mask}>",
        preprocess=bwd_preprocess_plan(dtype_name),
        passes=(("keys", kern), ("dq_convert", bwd_convert_dq_plan(dtype_name))),
        dq_accum_row=dpad + TC_BWD_DQ_PAD, deterministic=bool(deterministic), lse_acc=False)


def bwd_hopper_reason(prob, compute_capability: Optional[int]) -> Optional[str]:
    """Why the Hopper backward cannot run these inputs, or None if it can: the tensor-core
    backward's conditions (`bwd_tensorcore_reason`) and compute capability 9.0."""
    if compute_capability != 90:
        return ("the Hopper backward is built for sm_90a and runs on compute capability 9.0 "
                f"only (this GPU: {compute_capability})")
    return bwd_tensorcore_reason(prob, compute_capability, max_d=max(HOPPER_BWD_CONFIGS))


def backward_dq_accum_row_bound(dtype_name: str, d: int) -> int:
    """An upper bound on `BackwardPlan.dq_accum_row` (the float32 dq accumulator's row length,
    0 without one) over every plain backward plan `backward_plan_for` can return for this dtype
    and head dim on any device: the largest tile bucket of the tensor-core, Hopper and float32
    tensor-core backwards that takes `d`, plus TC_BWD_DQ_PAD. The JAX layer sizes its XLA-owned
    workspace with it at trace time, before the device's plan is known."""
    tables = {"float16": (TC_BWD_CONFIGS, HOPPER_BWD_CONFIGS),
              "bfloat16": (TC_BWD_CONFIGS, HOPPER_BWD_CONFIGS),
              "float32": (TC_BWD_F16SPLIT_CONFIGS,)}.get(dtype_name, ())
    row = 0
    for table in tables:
        try:
            row = max(row, head_dim_bucket(d, table) + TC_BWD_DQ_PAD)
        except ValueError:  # a head dim this backward does not take
            pass
    return row


def backward_plan_for(prob, compute_capability: Optional[int]) -> BackwardPlan:
    """The backward plan for a validated `BackwardProblem` on a device of this compute capability.

    ``kernel="generic"`` gives the generic backward; ``"auto"`` the tensor-core backward where
    the inputs qualify (`bwd_tensorcore_reason`), else the generic one; ``"tensorcore"`` demands
    the tensor-core backward and raises ValueError saying why it cannot run; ``"hopper"`` demands
    the Hopper backward (`bwd_hopper_reason`) in the same way, and ``"auto"`` takes it first when
    `HOPPER_BWD_AUTO` is set. `backward_fallback_reason` says why ``"auto"`` fell back.
    """
    if getattr(prob, "variant", None) is not None:   # window, softcap, alibi, bias, mask
        from ._dispatch_variants import variant_backward_plan_for
        return variant_backward_plan_for(prob, compute_capability)
    deterministic = bool(getattr(prob, "deterministic", False))
    if prob.dtype_name == "float32" and (prob.kernel == "tensorcore" or
                                         (prob.kernel == "auto" and TC_BWD_F32_AUTO)):
        why_not = _bwd_f32_auto_reason(prob, compute_capability)
        if why_not is None:
            return bwd_tensorcore_f32_plan(prob.d, prob.causal, deterministic, compute_capability)
        if prob.kernel == "tensorcore":
            raise ValueError(f"kernel='tensorcore' cannot run this backward: {why_not}")
    if prob.kernel == "hopper" or (prob.kernel == "auto" and HOPPER_BWD_AUTO):
        why_not = bwd_hopper_reason(prob, compute_capability)
        if why_not is None:
            return bwd_hopper_plan(prob.dtype_name, prob.d, prob.causal, deterministic)
        if prob.kernel == "hopper":
            raise ValueError(f"kernel='hopper' cannot run this backward: {why_not}")
    if prob.kernel in ("auto", "tensorcore"):
        why_not = bwd_tensorcore_reason(prob, compute_capability)
        if why_not is None:
            return bwd_tensorcore_plan(prob.dtype_name, prob.d, prob.causal,
                                       bool(getattr(prob, "deterministic", False)),
                                       compute_capability)
        if prob.kernel == "tensorcore":
            raise ValueError(f"kernel='tensorcore' cannot run this backward: {why_not}")
    return bwd_generic_plan(prob.dtype_name, prob.d, prob.dv, prob.causal)


def backward_fallback_reason(prob, compute_capability: Optional[int]) -> Optional[str]:
    """Why ``kernel="auto"`` runs the generic backward for these inputs (None when it does not)."""
    if getattr(prob, "variant", None) is not None:   # the variants' own conditions
        from ._dispatch_variants import variant_backward_fallback_reason
        return variant_backward_fallback_reason(prob, compute_capability)
    if prob.kernel != "auto":
        return None
    if prob.dtype_name == "float32" and TC_BWD_F32_AUTO:
        return _bwd_f32_auto_reason(prob, compute_capability)
    if HOPPER_BWD_AUTO and bwd_hopper_reason(prob, compute_capability) is None:
        return None  # the Hopper backward runs (D = 256 included, which mma.sync does not take)
    return bwd_tensorcore_reason(prob, compute_capability)


def all_backward_specialisations(compute_capability: int = 90):
    """Every backward plan the dispatcher can return on a device of this compute capability
    (tests/test_compile.py builds each plan's kernels for sm_80 and sm_90)."""
    plans = []
    for dt in _CXX_TYPE:
        for db in (32, 64, 128, 256):
            for causal in (False, True):
                plans.append(bwd_generic_plan(dt, db, db, causal))
    # Tensor-core plans of this architecture and of those it stands for in the compile check
    # (sm_80 also builds the sm_86 / sm_89 tiles).
    archs = [compute_capability] + ([86] if compute_capability == 80 else [])
    for cc in archs:
        for dt in TC_BWD_DTYPES:
            for dpad in TC_BWD_CONFIGS:
                for causal in (False, True):
                    for det in (False, True):
                        bp = bwd_tensorcore_plan(dt, dpad, causal, det, cc)
                        if all(bp.label != x.label or bp.passes != x.passes for x in plans):
                            plans.append(bp)
        for dpad in TC_BWD_F16SPLIT_CONFIGS:  # float32, "3xfp16" (kernel="tensorcore")
            for causal in (False, True):
                for det in (False, True):
                    bp = bwd_tensorcore_f32_plan(dpad, causal, det, cc)
                    if all(bp.label != x.label or bp.passes != x.passes for x in plans):
                        plans.append(bp)
    if compute_capability == 90:  # the Hopper backward (sm_90a; kernel="hopper", or auto)
        for dt in HOPPER_BWD_DTYPES:
            for dpad in HOPPER_BWD_CONFIGS:
                for causal in (False, True):
                    for det in (False, True):
                        plans.append(bwd_hopper_plan(dt, dpad, causal, det))
    return plans


def bwd_candidate_plans(compute_capability: int = 90):
    """The tensor-core backward plans of every entry of TC_BWD_CANDIDATES (both dtypes, masks and
    determinism modes) on a device of this compute capability, for the compile check."""
    plans = []
    saved = dict(TC_BWD_CONFIGS)
    try:
        for cand in TC_BWD_CANDIDATES.values():
            for dpad, cfg in cand.items():
                TC_BWD_CONFIGS[dpad] = cfg
                for dt in TC_BWD_DTYPES:
                    for causal in (False, True):
                        for det in (False, True):
                            bp = bwd_tensorcore_plan(dt, dpad, causal, det, compute_capability)
                            if all(bp.passes != x.passes for x in plans):
                                plans.append(bp)
                TC_BWD_CONFIGS.clear()
                TC_BWD_CONFIGS.update(saved)
    finally:
        TC_BWD_CONFIGS.clear()
        TC_BWD_CONFIGS.update(saved)
    return plans


def backward_kernel_specs(compute_capability: int = 90):
    """The distinct kernel specialisations of `all_backward_specialisations` (preprocess and
    dq conversion included)."""
    specs = []
    for bp in all_backward_specialisations(compute_capability):
        for plan in (bp.preprocess,) + tuple(p for _, p in bp.passes):
            if plan.spec not in specs:
                specs.append(plan.spec)
    for dt in TC_DTYPES + ("float32",):
        spec = bwd_convert_dq_plan(dt).spec
        if spec not in specs:
            specs.append(spec)
    return specs


# ---------------------------------------------------------------------------------------------
# Packed variable-length batches (cuflash/_varlen_backward.py): every kernel of a backward plan
# has a `_varlen` twin (kernels_cu: the plain body on the segment view of its block's sequence,
# common.cuh: bwd_varlen_segment) with the same template arguments and launch configuration.

def _varlen_kernel(plan: Plan) -> Plan:
    family, name = plan.spec.family, plan.spec.name
    head, sep, targs = name.partition("<")
    return Plan(label="varlen-" + plan.label, spec=Specialisation(family, head + "_varlen" + sep
                                                                  + targs),
                block_m=plan.block_m, block_n=plan.block_n, threads=plan.threads,
                smem_bytes=plan.smem_bytes)


def varlen_backward_plan(bplan: BackwardPlan) -> BackwardPlan:
    """The packed-varlen form of a plain backward plan (same tiles, same passes)."""
    return BackwardPlan(label="varlen-" + bplan.label, preprocess=_varlen_kernel(bplan.preprocess),
                        passes=tuple((g, _varlen_kernel(p)) for g, p in bplan.passes),
                        dq_accum_row=bplan.dq_accum_row, deterministic=bplan.deterministic,
                        lse_acc=bplan.lse_acc)


def varlen_backward_kernel_specs(compute_capability: int = 90):
    """The `_varlen` twins of `backward_kernel_specs` (the varlen entry point takes float16 and
    bfloat16 on the tensor-core plans, every dtype on the generic ones)."""
    specs = []
    for bp in all_backward_specialisations(compute_capability):
        if bp.label.startswith("hopper-bwd") or "3xfp16" in bp.label:  # never picked for varlen
            continue
        for plan in (bp.preprocess,) + tuple(p for _, p in bp.passes):
            spec = _varlen_kernel(plan).spec
            if spec not in specs:
                specs.append(spec)
    return specs


#: The dense varlen forward's exceptions to the mma.sync tile table (TC_CONFIGS, TC_ARCH_CONFIGS),
#: {first compute capability: {dpad: config}} as TC_ARCH_CONFIGS: the twin (kernels_cu/attn_mma.cu:
#: cuflash_fwd_mma_varlen) reads its segment view from shared memory, which on sm_80 at D = 128
#: under the causal mask took the plain kernel's 254 registers over the edge (8 bytes spilled,
#: NVRTC 13.0); with direct stores of O instead of the staged epilogue it compiles at 254 with no
#: spills (same values stored, so the same bits). sm_90 takes the same exception since NVRTC 13.5
#: spilled 8 bytes there too (both masks, float16 and bfloat16; CI, 2026-12-02), where 13.0 had
#: not: the staged form sat at the edge of the register file on both architectures.
#: sm_86 / sm_89 (99 KiB a block): D = 256 takes 48-key tiles, 84480 bytes beside the twin's 256
#: static ones, where the plain kernel's 64-key tiles need 101376 + 256 > 101376 (the plain
#: kernel itself, without the segment view, fills the 99 KiB exactly).
TC_VARLEN_ARCH_CONFIGS = {80: {128: (48, 4, 2, 2, False)},
                          86: {128: (48, 4, 2, 2, False), 256: (48, 4, 1, 2, True)},
                          90: {128: (48, 4, 2, 2, False)}}


def varlen_tensorcore_plan(dtype_name: str, d: int, causal: bool,
                           compute_capability: int) -> Plan:
    """The dense varlen forward's plan: `tensorcore_plan`'s with the varlen twin's kernel
    (`_varlen_kernel`) and its tile exceptions (TC_VARLEN_ARCH_CONFIGS, 16-bit dtypes only).
    attention_varlen's GPU path takes float16/bfloat16 only: the float32 (3xfp16) twins compile,
    but sm_80 D = 256 spilled 4 bytes (NVRTC 13.0), so float32 is not offered."""
    if dtype_name not in ("float16", "bfloat16"):
        raise ValueError(f"the dense varlen forward takes float16 and bfloat16, not {dtype_name}")
    arch = max((a for a in TC_VARLEN_ARCH_CONFIGS if a <= compute_capability), default=None)
    table = TC_VARLEN_ARCH_CONFIGS.get(arch, {})
    plan = tensorcore_plan(dtype_name, d, causal, compute_capability,
                           config=lambda dpad, cfg: table.get(dpad, cfg))
    return _varlen_kernel(plan)


def varlen_forward_kernel_specs(compute_capability: int = 90):
    """The dense varlen forward's kernels (attention_varlen's "tensorcore" path, cuflash/_varlen.py:
    varlen_plan_for): float16 and bfloat16, every head-dim bucket, both masks."""
    archs = [compute_capability] + ([86] if compute_capability == 80 else [])  # sm_80 builds
    specs = [varlen_tensorcore_plan(dt, dpad, causal, cc).spec         # sm_86 / 89's tiles too
             for cc in archs for dt in ("float16", "bfloat16") for dpad in TC_CONFIGS
             for causal in (False, True)]
    return list(dict.fromkeys(specs))


def varlen_hopper_plan(dtype_name: str, d: int, causal: bool, max_q: int, max_k: int) -> Plan:
    """The Hopper varlen forward's plan (kernels_cu/attn_wgmma.cu: cuflash_fwd_wgmma_varlen): the
    dense choice for max_seqlen_q/k (`hopper_plan`: tiles by head dim, mask and key count), one
    slot per block (not persistent: a block's view is its own sequence's), pairs of query blocks
    under the causal mask as the dense kernel."""
    import dataclasses

    plan = hopper_plan(dtype_name, d, causal, max_k, sq=max_q,
                       choose=lambda dpad, cfg, persistent: (cfg, False))
    name = plan.spec.name.replace("cuflash_fwd_wgmma<", "cuflash_fwd_wgmma_varlen<")
    return dataclasses.replace(plan, label="varlen-" + plan.label,
                               spec=Specialisation(plan.spec.family, name, arch=plan.spec.arch))


def varlen_hopper_kernel_specs():
    """The Hopper varlen twins the dispatcher can pick (sm_90a): float16 and bfloat16, every entry
    of HOPPER_TABLE, with the narrower block short query counts take."""
    specs = []
    for dt in HOPPER_DTYPES:
        for dpad, causal, long_keys in HOPPER_TABLE:
            for sq in (HOPPER_LONG_SK, 1):
                spec = varlen_hopper_plan(dt, dpad, causal, sq,
                                          HOPPER_LONG_SK + long_keys).spec
                if spec not in specs:
                    specs.append(spec)
    return specs
