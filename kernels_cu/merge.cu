// merge.cu: the merge operator of the online-softmax recurrence, for normalised partial results.
//
// Two partial attention results over disjoint key sets, (o_a, lse_a) and (o_b, lse_b), combine as
//   lse = logaddexp(lse_a, lse_b),  o = o_a exp(lse_a - lse) + o_b exp(lse_b - lse).
// It is associative and commutative; (o = 0, lse = -inf) is its identity, and two empty partials
// give an empty result (o = 0, lse = -inf) rather than NaN.
//
// One thread per output element; rows are contiguous, so row r of o and lse sits at r * dv and r.
// The row's weights are recomputed by each of its dv threads: two exp and a log per element is far
// below the cost of the memory traffic of this memory-bound kernel.
#include "common.cuh"

namespace cuflash {

template <typename T, typename Acc>
__global__ void cuflash_merge_states(const T* o_a, const float* lse_a, const T* o_b,
                                     const float* lse_b, T* o, float* lse, long long rows,
                                     long long dv) {
    const long long idx = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (idx >= rows * dv) return;
    const long long r = idx / dv;
    const long long c = idx - r * dv;
    const Acc la = static_cast<Acc>(lse_a[r]);
    const Acc lb = static_cast<Acc>(lse_b[r]);
    const Acc mx = fmax(la, lb);
    Acc wa, wb, lse_r;
    if (mx == neg_inf<Acc>()) {            // both partials saw no key
        wa = Acc(0); wb = Acc(0); lse_r = mx;
    } else {
        const Acc ea = exp(la - mx), eb = exp(lb - mx);
        const Acc sum = ea + eb;
        wa = ea / sum; wb = eb / sum;
        lse_r = mx + log(sum);
    }
    const Acc val = wa * load_acc<Acc>(o_a + idx) + wb * load_acc<Acc>(o_b + idx);
    o[idx] = from_acc<T>(val);
    if (c == 0) lse[r] = static_cast<float>(lse_r);
}

}  // namespace cuflash
