"""The order of the Hopper backward's phases (kernels_cu/attn_bwd_wgmma.cu, the D = 256 SPLIT
form) as a list of operations, and a checker of the orderings each schedule relies on.

tests/bwd_wgmma_model.py computes every product one after another, so it cannot see the order
in which the kernel issues, waits for and overlaps them: that is what this module models, for
both schedules of the SPLIT form (`overlap`: _dispatch.HOPPER_BWD_OVERLAP, template argument
OV). Both warpgroups run the same program, every barrier is block-wide (bar.sync 0, all 256
threads, executed unconditionally once per tile), so the block's time is cut into *epochs* by
barriers, and the checker asks, for every shared-memory buffer and accumulator:

- an access happens within an interval of epochs: an ordinary store or load (st.shared,
  ld.shared) in the epoch it is issued in; a cp.async write from its issue to the epoch of the
  cp.async wait that retires it; a wgmma's operand reads from its issue to the epoch of the
  wgmma.wait_group that retires its commit group (the other warpgroup may be anywhere in the
  same epoch);
- a write and any other access to the same buffer must lie in disjoint intervals (a barrier
  between them), except two wgmma reads;
- a write that a later wgmma reads must be made visible to the async proxy: an ordinary store
  is followed by fence.proxy.async before the next barrier, a cp.async by its wait and then the
  fence before the next barrier;
- an accumulator is not touched by the thread (P^T's exp2, dS^T, the dq atomics, fence_regs)
  while a commit group that writes it is pending (a wgmma on the same accumulator may follow:
  the tensor cores keep the order);
- nothing is pending when the block ends.

The same lists give, per tile, the sequence of barriers, commit groups (their wgmma shapes) and
waits that the SASS of the loop must show (tests/test_compile.py compares them), which ties the
list to the kernel. What it does not model: global memory (the dq atomics and the turn counters
of the deterministic mode, whose order the schedules share), and the warp-level DET poll.
"""

DPAD, BM, BN = 256, 64, 64
SN, DKV_N = BM // 2, DPAD // 2  # queries of S^T, dP^T and columns of dK, dV per warpgroup


def tile_ops(it, n_iter, overlap):
    """The operations of one query tile (it of n_iter) of one warpgroup, in program order:
    (op, arg, ...) with op in cpwait, fence, bar, cp (buffer), cpcommit, sts / lds (buffer),
    mma (reads, accumulator, (N, count)), commit, wait (N), use (accumulator)."""
    b, nb = it % 2, 1 - it % 2
    more = it + 1 < n_iter
    q, do, ld = f"Q{b}", f"dO{b}", f"ld{b}"  # ld: the tile's lse * log2(e) and delta
    ops = [("cpwait",), ("fence",), ("bar", "1")]
    loads = ([("cp", f"Q{nb}"), ("cp", f"dO{nb}")] if more else []) + [("cpcommit",)]
    if not overlap:
        ops += loads
    ops += [("mma", ("K", q), "s", (SN, DPAD // 16)), ("commit",),
            ("mma", ("V", do), "dp", (SN, DPAD // 16)), ("commit",)]
    if overlap:
        ops += loads
    ops += [("wait", 1), ("use", "s"), ("lds", ld)]  # P^T = exp2(S^T scale - lse)
    if overlap:  # P^T published by barrier 1b, dV in flight under dS^T
        ops += [("sts", "PT"), ("fence",), ("bar", "1b"),
                ("mma", ("PT", do), "dv", (DKV_N, BM // 16)), ("commit",)]
    ops += [("wait", 1 if overlap else 0), ("use", "dp"), ("lds", ld)]  # dS^T
    if not overlap:
        ops += [("sts", "PT")]
    ops += [("sts", "dST"), ("sts", "dS")]
    if more:
        ops += [("sts", f"ld{nb}")]
    ops += [("fence",), ("bar", "2")]
    if not overlap:
        ops += [("mma", ("PT", do), "dv", (DKV_N, BM // 16)),
                ("mma", ("dST", q), "dk", (DKV_N, BM // 16))]
    ops += [("mma", ("dS", "K"), "dq", (64, 2 * BN // 16)), ("commit",)]
    if overlap:
        ops += [("mma", ("dST", q), "dk", (DKV_N, BM // 16)), ("commit",), ("wait", 1)]
    else:
        ops += [("wait", 0), ("use", "dk")]
    ops += [("use", "dv"), ("use", "dq")]  # the dq atomics
    if overlap:
        ops += [("wait", 0), ("use", "dk")]
    return ops


def block_ops(n_iter, overlap):
    """A block's whole program: K, V and the first tile's loads, the tiles, the final wait."""
    ops = [("cp", "K"), ("cp", "V"), ("cp", "Q0"), ("cp", "dO0"), ("sts", "ld0"), ("cpcommit",)]
    for it in range(n_iter):
        ops += tile_ops(it, n_iter, overlap)
    return ops + [("cpwait",)]


def check(ops):
    """The violations of the rules in the module docstring ([] when the program is right)."""
    errors = []
    epoch = 0
    accesses = []  # (buffer, kind, first epoch, last epoch, op index); kind: w (write) or r
    groups, open_group = [], []  # pending commit groups: [(accumulators, [access slots])]
    cp_open, cp_pending = [], []  # cp.async accesses of the open / committed groups
    unfenced = []  # ordinary stores and landed cp.asyncs not yet fenced
    for i, op in enumerate(ops):
        kind = op[0]
        if kind == "bar":
            for what in unfenced:
                errors.append(f"op {i}: {what} not fenced (fence.proxy.async) before barrier {op[1]}")
            unfenced = []
            epoch += 1
        elif kind == "fence":
            unfenced = []
        elif kind == "cp":
            accesses.append([op[1], "w", epoch, None, i])
            cp_open.append(len(accesses) - 1)
        elif kind == "cpcommit":
            cp_pending += cp_open
            cp_open = []
        elif kind == "cpwait":  # cp.async.wait_group 0: all committed groups land
            for k in cp_pending + cp_open:
                accesses[k][3] = epoch
                unfenced.append(f"cp.async into {accesses[k][0]}")
            cp_pending, cp_open = [], []
        elif kind in ("sts", "lds"):
            accesses.append([op[1], "w" if kind == "sts" else "r", epoch, epoch, i])
            if kind == "sts":
                unfenced.append(f"st.shared into {op[1]}")
        elif kind == "mma":
            _, reads, acc, _ = op
            slots = []
            for buf in reads:
                accesses.append([buf, "a", epoch, None, i])
                slots.append(len(accesses) - 1)
            open_group.append((acc, slots))
        elif kind == "commit":
            groups.append(open_group)
            open_group = []
        elif kind == "wait":
            if open_group:
                errors.append(f"op {i}: wgmmas issued but not committed before a wait")
            while len(groups) > op[1]:
                for _, slots in groups.pop(0):
                    for k in slots:
                        accesses[k][3] = epoch
        elif kind == "use":
            pending = {acc for g in groups for acc, _ in g} | {acc for acc, _ in open_group}
            if op[1] in pending:
                errors.append(f"op {i}: accumulator {op[1]} touched while its wgmma is pending")
    if groups or open_group:
        errors.append("wgmma groups pending at the end of the block")
    if cp_pending or cp_open:
        errors.append("cp.async pending at the end of the block")
    for a in range(len(accesses)):
        buf, ka, a0, a1, ia = accesses[a]
        if a1 is None:
            errors.append(f"op {ia}: an access of {buf} never completes")
            continue
        for b in range(a + 1, len(accesses)):
            buf_b, kb, b0, b1, ib = accesses[b]
            if buf_b != buf or "w" not in (ka, kb) or b1 is None:
                continue
            if a0 <= b1 and b0 <= a1:  # the intervals share an epoch: no barrier between them
                errors.append(f"ops {ia} and {ib}: {buf} accessed ({ka}, {kb}) in one epoch "
                              f"range ({a0}-{a1}, {b0}-{b1})")
    return errors


def sass_sequence(ops_of_tile):
    """The tile's barriers, commit groups ({N: wgmmas}) and waits, as the SASS of the loop shows
    them: ("bar",), ("group", ((N, count), ...)), ("wait", N)."""
    seq, group = [], {}
    for op in ops_of_tile:
        if op[0] == "bar":
            seq.append(("bar",))
        elif op[0] == "mma":
            n, count = op[3]
            group[n] = group.get(n, 0) + count
        elif op[0] == "commit":
            seq.append(("group", tuple(sorted(group.items()))))
            group = {}
        elif op[0] == "wait":
            seq.append(("wait", op[1]))
    return seq
