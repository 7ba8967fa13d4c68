"""The online-softmax recurrence by hand, on the worked examples of docs/online-softmax.md.

Streams a score row chunk by chunk through ``cuflash.reference`` and prints the running state
(m, l, O) after each chunk, then the final ``O / l`` next to the all-at-once softmax.

    python examples/worked_example.py      # with cuflash installed (or PYTHONPATH=. from the repo root)
"""
import numpy as np
from scipy.special import softmax

from cuflash import reference as ref


def stream(title, chunks_s, chunks_v):
    print(title)
    state = ref.init_state((), chunks_v[0].shape[-1])
    print(f"  start              m = {state.m:>7}   l = {state.l:.7f}   O = {state.O}")
    for t, (s_c, v_c) in enumerate(zip(chunks_s, chunks_v), start=1):
        m_old = state.m
        state = ref.update(state, s_c, v_c)
        alpha = np.exp(m_old - state.m)
        print(f"  chunk {t} {np.asarray(s_c).tolist()!s:<11} m = {state.m:>7}   l = {state.l:.7f}"
              f"   O = {np.array2string(state.O, precision=7)}   (alpha = {alpha:.4g})")
    o, lse = ref.finalize(state)
    s_all = np.concatenate(chunks_s)
    v_all = np.concatenate(chunks_v)
    print(f"  result O / l = {np.array2string(o, precision=7)}   lse = m + log l = {lse:.7f}")
    print(f"  all at once  = {np.array2string(softmax(s_all) @ v_all, precision=7)}"
          f"   softmax(s) = {np.array2string(softmax(s_all), precision=4)}")
    print()
    return o


ones = np.ones((2, 1))
stream("s = [1, 2, 3, 10], V all ones, chunks [1, 2] then [3, 10]",
       [np.array([1.0, 2.0]), np.array([3.0, 10.0])], [ones, ones])
stream("the same, chunks in reverse order: m = 10 from the start, every alpha = 1",
       [np.array([3.0, 10.0]), np.array([1.0, 2.0])], [ones, ones])
o = stream("s = [0, 5], V = [[2], [3]], chunks [0] then [5]",
           [np.array([0.0]), np.array([5.0])], [np.array([[2.0]]), np.array([[3.0]])])
print(f"3 - 1/(1 + e^5) = {3 - 1 / (1 + np.exp(5.0)):.7f}  (result above: {o[0]:.7f})")
