"""Write kernels_cu/wgmma_ops.cuh: inline-PTX wrappers for the warpgroup MMAs that attn_wgmma.cu uses.

A wgmma's accumulator fragment is N/2 fp32 registers per thread, and inline PTX names each one as
its own operand, so the wrappers are long lists that no template can produce. This script writes
them; run it after changing the shapes below and commit both files (tests/test_compile.py checks
that the header is current):

    python kernels_cu/gen_wgmma.py
"""
from pathlib import Path

N_VALUES = (32, 64, 80, 128, 176, 256)  # BN choices for S = Q K^T, padded head dims for P V, and
# (32) the D = 256 backward's S^T / dP^T halves (kernels_cu/attn_bwd_wgmma.cu, SPLIT)
TYPES = {"fp16_t": "f16", "bf16_t": "bf16"}
# float32 operands as TF32 (k8, no transpose: both shared-memory operands K-major): BN choices and
# padded head dims of the float32 form (cuflash/_dispatch.py: HOPPER_F32_TABLE).
TF32_N_VALUES = (32, 64, 128)
OUT = Path(__file__).with_name("wgmma_ops.cuh")


def _regs(first, count):
    return ", ".join(f"%{i}" for i in range(first, first + count))


def _acc_operands(count):
    return ", ".join(f'"+f"(d[{i}])' for i in range(count))


def wrapper(ctype, ptype, n):
    nacc = n // 2
    ss = (f'"{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{nacc + 2}, 0;\\n"\n'
          f'            "wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{ptype}.{ptype} "\n'
          f'            "{{{_regs(0, nacc)}}}, %{nacc}, %{nacc + 1}, p, 1, 1, 0, 0;\\n}}\\n"\n'
          f'            : {_acc_operands(nacc)}\n'
          f'            : "l"(desc_a), "l"(desc_b), "r"(scale_d) : "memory");')
    rs = (f'"{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{nacc + 5}, 0;\\n"\n'
          f'            "wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{ptype}.{ptype} "\n'
          f'            "{{{_regs(0, nacc)}}}, {{{_regs(nacc, 4)}}}, %{nacc + 4}, p, 1, 1, 1;\\n}}\\n"\n'
          f'            : {_acc_operands(nacc)}\n'
          f'            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d)\n'
          f'            : "memory");')
    # Shared-memory operands transposed: B only (imm-trans-b = 1), or both: the backward's
    # dQ = dS K (kernels_cu/attn_bwd_wgmma.cu), B = K read from K rows, A = dS stored K-major or
    # read from dS^T (M-major).
    sst = ss.replace("p, 1, 1, 0, 0;", "p, 1, 1, 0, 1;")
    sstt = ss.replace("p, 1, 1, 0, 0;", "p, 1, 1, 1, 1;")
    # D = A B with D as outputs only ("=f", scale-d false): the first k step of a product whose
    # accumulator is dead before it, so that the compiler does not keep the old values live
    # (through a loop, with "+f" they are inputs of the asm).
    first = (lambda t: t.replace('"+f"', '"=f"')
             .replace('"r"(scale_d) : "memory");', '"r"(0) : "memory");'))
    ss0, sst0, sstt0 = first(ss), first(sst), first(sstt)
    return f"""template <> struct Wgmma<{ctype}, {n}> {{
    // D(64 x {n}) (+)= A(64 x 16) B(16 x {n}); A and B K-major in shared memory.
    static __device__ __forceinline__ void ss(float (&d)[{nacc}], unsigned long long desc_a,
                                              unsigned long long desc_b, int scale_d) {{
        asm volatile({ss}
    }}
    // D(64 x {n}) (+)= A(64 x 16) B(16 x {n}); A from registers, B N-major in shared memory.
    static __device__ __forceinline__ void rs(float (&d)[{nacc}], const unsigned int (&a)[4],
                                              unsigned long long desc_b, int scale_d) {{
        asm volatile({rs}
    }}
    // D(64 x {n}) (+)= A(64 x 16) B(16 x {n}); A K-major and B N-major in shared memory.
    static __device__ __forceinline__ void sst(float (&d)[{nacc}], unsigned long long desc_a,
                                               unsigned long long desc_b, int scale_d) {{
        asm volatile({sst}
    }}
    // D(64 x {n}) (+)= A(64 x 16) B(16 x {n}); A M-major and B N-major in shared memory.
    static __device__ __forceinline__ void sstt(float (&d)[{nacc}], unsigned long long desc_a,
                                                unsigned long long desc_b, int scale_d) {{
        asm volatile({sstt}
    }}
    // D(64 x {n}) = A(64 x 16) B(16 x {n}), D written only: as ss / sst / sstt with
    // scale_d = 0.
    static __device__ __forceinline__ void ss0(float (&d)[{nacc}], unsigned long long desc_a,
                                               unsigned long long desc_b) {{
        asm volatile({ss0}
    }}
    static __device__ __forceinline__ void sst0(float (&d)[{nacc}], unsigned long long desc_a,
                                                unsigned long long desc_b) {{
        asm volatile({sst0}
    }}
    static __device__ __forceinline__ void sstt0(float (&d)[{nacc}], unsigned long long desc_a,
                                                 unsigned long long desc_b) {{
        asm volatile({sstt0}
    }}
}};
"""


def wrapper_tf32(n):
    """Wgmma<float, N>: m64nNk8 with TF32 operands. Unlike the 16-bit forms the instruction has no
    transpose immediates: A and B in shared memory must both be K-major."""
    nacc = n // 2
    ss = (f'"{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{nacc + 2}, 0;\\n"\n'
          f'            "wgmma.mma_async.sync.aligned.m64n{n}k8.f32.tf32.tf32 "\n'
          f'            "{{{_regs(0, nacc)}}}, %{nacc}, %{nacc + 1}, p, 1, 1;\\n}}\\n"\n'
          f'            : {_acc_operands(nacc)}\n'
          f'            : "l"(desc_a), "l"(desc_b), "r"(scale_d) : "memory");')
    rs = (f'"{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{nacc + 5}, 0;\\n"\n'
          f'            "wgmma.mma_async.sync.aligned.m64n{n}k8.f32.tf32.tf32 "\n'
          f'            "{{{_regs(0, nacc)}}}, {{{_regs(nacc, 4)}}}, %{nacc + 4}, p, 1, 1;\\n}}\\n"\n'
          f'            : {_acc_operands(nacc)}\n'
          f'            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d)\n'
          f'            : "memory");')
    return f"""template <> struct Wgmma<float, {n}> {{
    // D(64 x {n}) (+)= A(64 x 8) B(8 x {n}), TF32; A and B K-major in shared memory.
    static __device__ __forceinline__ void ss(float (&d)[{nacc}], unsigned long long desc_a,
                                              unsigned long long desc_b, int scale_d) {{
        asm volatile({ss}
    }}
    // D(64 x {n}) (+)= A(64 x 8) B(8 x {n}), TF32; A from registers (TF32 bit patterns), B
    // K-major in shared memory.
    static __device__ __forceinline__ void rs(float (&d)[{nacc}], const unsigned int (&a)[4],
                                              unsigned long long desc_b, int scale_d) {{
        asm volatile({rs}
    }}
}};
"""


def main():
    parts = ["// wgmma_ops.cuh: GENERATED by kernels_cu/gen_wgmma.py, do not edit by hand.\n"
             "//\n"
             "// Wgmma<T, N>::ss / ::rs (16-bit T also ::sst / ::sstt: B / both shared-memory operands\n"
             "// transposed; ::ss0 / ::sst0 / ::sstt0: D = A B, D written only)\n"
             "// issue one wgmma.mma_async m64nNk16 (16-bit T) or m64nNk8 (T = float: TF32 operands)\n"
             "// with fp32 accumulators\n"
             "// (sm_90a). scale_d = 0 overwrites the accumulators, 1 adds to them. They only issue:\n"
             "// the caller fences (wgmma.fence) before and commits/waits after.\n"
             "#pragma once\n\nnamespace cuflash {\n\ntemplate <typename T, int N> struct Wgmma;\n"]
    for ctype, ptype in TYPES.items():
        for n in N_VALUES:
            parts.append(wrapper(ctype, ptype, n))
    for n in TF32_N_VALUES:
        parts.append(wrapper_tf32(n))
    parts.append("}  // namespace cuflash\n")
    text = "\n".join(parts)
    return text


if __name__ == "__main__":
    OUT.write_text(main())
    print(f"wrote {OUT}")
