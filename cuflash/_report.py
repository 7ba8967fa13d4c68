"""``cuflash-check --report DIR``: a self-contained HTML page with PNG plots of an audit.

The page (``DIR/index.html``) references only the PNG files written beside it, no scripts, no
style sheets or fonts from elsewhere, so the directory can be copied, archived or attached as it
is. Plots (matplotlib, the optional ``report`` extra, drawn off-screen with the Agg backend):

* ``cases_threshold.png``: every case's error against its 2x-naive threshold and against the
  largest element of its a-priori bound (log-log, one marker per dtype, failures in red);
* ``error_vs_seqlen.png``: error against the number of keys, one panel per dtype, one series per
  kernel;
* ``fractions.png``: the error as a fraction of each bar (err/threshold, err/bound) per case;
* ``properties.png``: the property audits as measured against limit;
* ``gradients.png``: where the audit has a gradient section, dq, dk, dv against their thresholds;
* ``prop_chunk_order.png``, ``prop_merge.png``, ``prop_overflow.png``,
  ``prop_alpha_underflow.png``: the recurrence's properties as pictures, computed here from
  :mod:`cuflash.reference` (float64) on small fresh examples.

Above the plots, every failed case, property and gradient case is listed with its reasons.
The inputs of :func:`write_report` are the JSON document of the audit
(:func:`cuflash._audit.to_json`), so a report can also be drawn from a saved ``--json`` file.
"""
from __future__ import annotations

import html
import math
import os
import re
from typing import Any, Dict, List

import numpy as np

from cuflash import reference

__all__ = ["write_report"]

_DTYPE_COLORS = {"float16": "#1f77b4", "bfloat16": "#9467bd", "float32": "#2ca02c",
                 "float64": "#8c564b"}
_KERNEL_MARKERS = ["o", "s", "^", "D", "v", "P", "X"]


def _num(x) -> float:
    """A JSON number back to float ("NaN", "Infinity" strings included)."""
    if isinstance(x, str):
        return {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}.get(x, math.nan)
    return math.nan if x is None else float(x)


def _dims(label: str):
    """(Sq, Sk, D, Dv) from a case label "(B,H,Sq,Sk,D,Dv)"; None if it has fewer numbers."""
    nums = [int(x) for x in re.findall(r"\d+", label or "")]
    return tuple(nums[-4:]) if len(nums) >= 4 else None


def _pyplot():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path):
    fig.savefig(path, dpi=110, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)


def _positive(x: float) -> float:
    """For log axes: NaN/inf and non-positive values are not drawn (NaN)."""
    return x if (math.isfinite(x) and x > 0) else math.nan


# ----------------------------------------------------------------------------------------------
# case plots
# ----------------------------------------------------------------------------------------------

def _plot_cases(cases: List[Dict[str, Any]], path: str) -> None:
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    for ax, key, title in ((axes[0], "threshold", "2x-naive threshold"),
                           (axes[1], "bound", "a-priori bound (largest element)")):
        lo, hi = math.inf, 0.0
        for dtype, color in _DTYPE_COLORS.items():
            sel = [c for c in cases if c["dtype"] == dtype]
            if not sel:
                continue
            x = np.array([_positive(_num(c[key])) for c in sel])
            y = np.array([_positive(_num(c["max_abs_err"])) for c in sel])
            ok = np.array([c["result"] == "PASS" for c in sel])
            ax.scatter(x[ok], y[ok], s=16, color=color, alpha=0.75, label=dtype)
            if (~ok).any():
                ax.scatter(x[~ok], y[~ok], s=40, facecolors="none", edgecolors="red",
                           linewidths=1.5, label=f"{dtype} FAIL")
            fin = np.isfinite(x) & np.isfinite(y)
            if fin.any():
                lo = min(lo, np.min(x[fin]), np.min(y[fin]))
                hi = max(hi, np.max(x[fin]), np.max(y[fin]))
        if hi > 0:
            line = np.array([lo / 2, hi * 2])
            ax.plot(line, line, color="black", lw=1, label="error = bar")
            ax.plot(line, line / 10, color="grey", lw=0.8, ls="--", label="error = bar / 10")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel(title)
        ax.set_ylabel("max |o - o_ref|")
        ax.set_title(f"error against the {title.split(' (')[0]}")
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(fontsize=8, loc="upper left")
    fig.suptitle("Every case below the black line passes that bar (both must hold)")
    _save(fig, path)


def _plot_fractions(cases: List[Dict[str, Any]], path: str) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(12, 4))
    idx = np.arange(len(cases))
    ft = np.array([_positive(_num(c.get("frac_threshold"))) for c in cases])
    fb = np.array([_positive(_num(c.get("frac_bound"))) for c in cases])
    ax.scatter(idx, ft, s=10, color="#1f77b4", label="err / 2x-naive threshold")
    ax.scatter(idx, fb, s=10, color="#ff7f0e", marker="s", label="err / a-priori bound")
    bad = [i for i, c in enumerate(cases) if c["result"] != "PASS"]
    if bad:
        ax.scatter(bad, np.nanmax(np.vstack([ft, fb])[:, bad], axis=0), s=60,
                   facecolors="none", edgecolors="red", label="FAIL")
    ax.axhline(1.0, color="black", lw=1)
    ax.set_yscale("log")
    ax.set_xlabel("case (in the order of the table)")
    ax.set_ylabel("fraction of the bar used")
    ax.set_title("The error as a fraction of each bar (a case passes when both are <= 1)")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    _save(fig, path)


def _plot_seqlen(cases: List[Dict[str, Any]], path: str) -> None:
    plt = _pyplot()
    dtypes = [d for d in _DTYPE_COLORS if any(c["dtype"] == d for c in cases)]
    n = max(1, len(dtypes))
    fig, axes = plt.subplots(1, n, figsize=(4.6 * n, 4.2), squeeze=False,
                             layout="constrained")
    # float32's product modes (3xtf32, tf32) are series of their own: errors 1e4 apart.
    from cuflash._audit import short_kernel
    kernels = sorted({short_kernel(c["kernel"]) for c in cases})
    for ax, dtype in zip(axes[0], dtypes):
        for ki, kern in enumerate(kernels):
            sel = [c for c in cases if c["dtype"] == dtype and short_kernel(c["kernel"]) == kern
                   and _dims(c["shape"])]
            if not sel:
                continue
            sk = np.array([_dims(c["shape"])[1] for c in sel], dtype=float)
            err = np.array([_positive(_num(c["max_abs_err"])) for c in sel])
            jitter = 1.0 + 0.04 * (ki - (len(kernels) - 1) / 2)
            ax.scatter(sk * jitter, err, s=14, marker=_KERNEL_MARKERS[ki % 7], alpha=0.7,
                       label=kern)
            # the median per key count, to show the trend
            ks = np.unique(sk)
            med = [np.median(e[np.isfinite(e)]) if np.isfinite(e).any() else np.nan
                   for e in (err[sk == s] for s in ks)]
            ax.plot(ks * jitter, med, lw=1, alpha=0.8)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("Sk (keys)")
        ax.set_ylabel("max |o - o_ref|")
        ax.set_title(dtype)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Error against sequence length, per dtype and kernel (line: median per Sk)")
    _save(fig, path)


def _plot_gradients(grads: List[Dict[str, Any]], path: str) -> None:
    """Each gradient case's dq, dk, dv error against its threshold."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.8))
    markers = {"dq": "o", "dk": "s", "dv": "^"}
    lo, hi = math.inf, 0.0
    for name, marker in markers.items():
        for dtype, color in _DTYPE_COLORS.items():
            sel = [g for g in grads if g["dtype"] == dtype and name in g.get("err", {})]
            if not sel:
                continue
            x = np.array([_positive(_num(g["threshold"][name])) for g in sel])
            y = np.array([_positive(_num(g["err"][name])) for g in sel])
            ok = np.array([g["result"] == "PASS" for g in sel])
            ax.scatter(x[ok], y[ok], s=14, marker=marker, color=color, alpha=0.7,
                       label=f"{name} {dtype}")
            if (~ok).any():
                ax.scatter(x[~ok], y[~ok], s=40, marker=marker, facecolors="none",
                           edgecolors="red", label=f"{name} {dtype} FAIL")
            fin = np.isfinite(x) & np.isfinite(y)
            if fin.any():
                lo = min(lo, np.min(x[fin]), np.min(y[fin]))
                hi = max(hi, np.max(x[fin]), np.max(y[fin]))
    if hi > 0:
        line = np.array([lo / 2, hi * 2])
        ax.plot(line, line, color="black", lw=1, label="error = threshold")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("threshold (2x naive backward)")
    ax.set_ylabel("max abs error")
    ax.set_title("Gradients: dq, dk, dv against their thresholds")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, ncol=2, loc="upper left")
    _save(fig, path)


def _grad_table(grads: List[Dict[str, Any]]) -> str:
    names = ("dq", "dk", "dv")
    head = ["dtype", "kernel", "shape", "causal"] + [f"{n} err / threshold" for n in names] \
        + ["result"]
    out = ["<table><tr>" + "".join(f"<th>{_e(h)}</th>" for h in head) + "</tr>"]
    for g in grads:
        ok = g["result"] == "PASS"
        cells = [g["dtype"], g["kernel"], g["shape"], "yes" if g["causal"] else "no"]
        cells += [f"{_fmt(g['err'].get(n))} / {_fmt(g['threshold'].get(n))}" for n in names]
        res = "<span class='pass'>PASS</span>" if ok else "<span class='fail-t'>FAIL</span>"
        tds = "".join(f"<td class='l'>{_e(x)}</td>" if i < 4 else f"<td>{_e(x)}</td>"
                      for i, x in enumerate(cells))
        title = "" if ok else f" title='{_e('; '.join(g.get('reasons', [])))}'"
        out.append(f"<tr class='{'' if ok else 'fail'}'{title}>{tds}<td>{res}</td></tr>")
    out.append("</table>")
    return "\n".join(out)


def _plot_properties(props: List[Dict[str, Any]], path: str) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(10, 0.35 * len(props) + 1.2))
    names = [f"{p['name']} [{p['where']}]" for p in props]
    y = np.arange(len(props))[::-1]
    meas = np.array([_num(p["measured"]) for p in props])
    lim = np.array([_num(p["limit"]) for p in props])
    floor = np.nanmin(np.where(lim > 0, lim, np.nan)) / 1e6 if np.any(lim > 0) else 1e-20
    shown = np.where(np.isfinite(meas) & (meas > 0), meas, floor)
    colors = ["#2ca02c" if p["result"] == "PASS" else "red" for p in props]
    ax.barh(y, shown, color=colors, alpha=0.8, label="measured")
    for yi, m in zip(y, meas):
        if m == 0:
            ax.text(floor * 1.5, yi, "exactly 0", va="center", fontsize=7)
    ax.scatter(lim, y, marker="|", s=300, color="black", label="limit")
    ax.set_yticks(y)
    ax.set_yticklabels(names, fontsize=8)
    ax.set_xscale("log")
    ax.set_xlabel("measured error (bar) and its limit (|)")
    ax.set_title("Property audits (green: PASS, red: FAIL)")
    ax.grid(True, axis="x", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    _save(fig, path)


# ----------------------------------------------------------------------------------------------
# the recurrence's properties as pictures (float64 reference, small fresh examples)
# ----------------------------------------------------------------------------------------------

def _plot_chunk_order(path: str, rng) -> None:
    from scipy.special import softmax

    plt = _pyplot()
    n = 1000
    s = 3.0 * rng.standard_normal((4, n))
    v = rng.standard_normal((n, 5))
    want = softmax(s, axis=-1) @ v
    counts, errs = [], []
    for n_chunks in (1, 2, 4, 8, 16, 32, 64, 128, 256, 1000):
        for _ in range(6):
            cuts = np.sort(rng.choice(np.arange(1, n), size=n_chunks - 1, replace=False))
            sizes = np.diff(np.concatenate([[0], cuts, [n]])).astype(int).tolist()
            order = rng.permutation(len(sizes))
            o, _ = reference.online_softmax(s, v, sizes, order)
            counts.append(n_chunks)
            errs.append(max(float(np.max(np.abs(o - want))), 1e-18))
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.scatter(counts, errs, s=14)
    ax.axhline(1e-12, color="red", lw=1, label="audit limit 1e-12")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("number of chunks (random sizes, random order)")
    ax.set_ylabel("max |recurrence - softmax @ v|")
    ax.set_title("Chunk-order invariance (float64, 1000 keys)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    _save(fig, path)


def _plot_merge(path: str, rng) -> None:
    from scipy.special import logsumexp, softmax

    plt = _pyplot()
    mg = reference.merge_normalized
    assoc, comm = [], []
    for _ in range(40):
        sizes = rng.integers(1, 60, size=3)
        n = int(sizes.sum())
        s = 4.0 * rng.standard_normal((6, n))
        v = rng.standard_normal((n, 4))
        parts, start = [], 0
        for m in sizes:
            sl = s[:, start:start + m]
            parts.append((softmax(sl, axis=-1) @ v[start:start + m], logsumexp(sl, axis=-1)))
            start += m
        a, b, c = parts
        left, right = mg(*mg(*a, *b), *c), mg(*a, *mg(*b, *c))
        assoc.append(float(np.max(np.abs(left[0] - right[0]))))
        ab, ba = mg(*a, *b), mg(*b, *a)
        comm.append(float(np.max(np.abs(ab[0] - ba[0]))))
    fig, ax = plt.subplots(figsize=(6, 4))
    for errs, label in ((assoc, "(a+b)+c vs a+(b+c)"), (comm, "a+b vs b+a")):
        errs = np.array(errs)
        nz = errs[errs > 1e-18]
        zeros = int(np.sum(errs <= 1e-18))
        text = f"{label}: {zeros} of {errs.size} exactly equal" if zeros else label
        if nz.size:
            ax.hist(np.log10(nz), bins=15, range=(-17, -11), alpha=0.7, label=text)
        else:
            ax.plot([], [], " ", label=text)
    ax.axvline(-12, color="red", lw=1, label="audit limit 1e-12")
    ax.set_xlabel("log10 max |difference| of merged outputs")
    ax.set_ylabel("trials")
    ax.set_title("Merge associativity and commutativity (float64, 40 random splits)")
    ax.legend(fontsize=8)
    _save(fig, path)


def _plot_overflow(path: str) -> None:
    plt = _pyplot()
    s = np.linspace(0.0, 14.0, 400)
    rows = np.stack([s, np.zeros_like(s)], axis=-1)       # two scores per row: s and 0
    unstable = reference.unstable_softmax(rows, np.float16)[:, 0].astype(np.float64)
    stable = 1.0 / (1.0 + np.exp(-s))
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(s, stable, color="black", lw=2, label="softmax (max subtracted)")
    ok = np.isfinite(unstable)
    ax.plot(s[ok], unstable[ok], color="#1f77b4", lw=1.5, ls="--",
            label="exp(s)/sum(exp(s)) in float16")
    if (~ok).any():
        ax.axvspan(math.log(65504.0), s.max(), color="red", alpha=0.15,
                   label="float16 exp(s) overflows: NaN (s > ln 65504 = 11.09)")
    ax.set_xlabel("score s (the other score is 0)")
    ax.set_ylabel("weight of s")
    ax.set_ylim(-0.05, 1.1)
    ax.set_title("fp16 overflow of the unstable formula")
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(True, alpha=0.3)
    _save(fig, path)


def _plot_alpha_underflow(path: str, rng) -> None:
    from scipy.special import softmax

    plt = _pyplot()
    s = np.concatenate([rng.standard_normal(512), 150.0 + rng.standard_normal(128)])
    v = rng.standard_normal((s.size, 1))
    _, _, hist = reference.online_softmax(s[None].astype(np.float32), v.astype(np.float32), 64,
                                          return_history=True)
    m = [float(h.m[0]) for h in hist]
    alpha = [1.0] + [float(np.exp(np.float32(a - b))) for a, b in zip(m[:-1], m[1:])]
    o, _ = reference.online_softmax(s[None].astype(np.float32), v.astype(np.float32), 64)
    err = abs(float(o[0, 0]) - float((softmax(s) @ v)[0]))
    fig, ax1 = plt.subplots(figsize=(6, 4))
    tiles = np.arange(1, len(m) + 1)
    ax1.plot(tiles, m, marker="o", color="black", label="running max m")
    ax1.set_xlabel("key tile (64 keys; the max jumps by ~150 at tile 9)")
    ax1.set_ylabel("running max m")
    ax2 = ax1.twinx()
    shown = [a if a > 0 else 1e-45 for a in alpha]
    ax2.semilogy(tiles, shown, marker="s", color="#d62728", label="alpha = exp(m_old - m_new)")
    for t, a in zip(tiles, alpha):
        if a == 0:
            ax2.annotate("alpha = 0 (underflow)", (t, 1e-45), textcoords="offset points",
                         xytext=(-125, 8), fontsize=8, color="#d62728")
    ax2.set_ylabel("alpha (float32: exp(-150) = 0)")
    ax1.set_title(f"alpha underflow: the float32 recurrence stays exact (error {err:.1e})")
    lines = ax1.get_legend_handles_labels()
    lines2 = ax2.get_legend_handles_labels()
    ax1.legend(lines[0] + lines2[0], lines[1] + lines2[1], fontsize=8, loc="center left")
    ax1.grid(True, alpha=0.3)
    _save(fig, path)


# ----------------------------------------------------------------------------------------------
# the page
# ----------------------------------------------------------------------------------------------

_CSS = """
body { font-family: sans-serif; margin: 1.5em auto; max-width: 1250px; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; margin-top: 1.6em; }
table { border-collapse: collapse; font-size: 0.82em; }
td, th { border: 1px solid #ccc; padding: 2px 6px; text-align: right; }
th { background: #f0f0f0; } td.l, th.l { text-align: left; }
tr.fail td { background: #fde0e0; } .pass { color: #1a7f1a; font-weight: bold; }
.fail-t { color: #c00; font-weight: bold; } img { max-width: 100%; border: 1px solid #ddd; }
.summary { font-size: 1.1em; padding: 0.5em; background: #f6f6f6; border: 1px solid #ddd; }
pre { white-space: pre-wrap; font-size: 0.82em; background: #f8f8f8; padding: 0.6em; }
"""


def _e(x) -> str:
    return html.escape(str(x))


def _fmt(x) -> str:
    x = _num(x)
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return f"{x:.2e}"


def _frac(x) -> str:
    x = _num(x)
    return "nan" if math.isnan(x) else ("inf" if math.isinf(x) else f"{x:.3f}")


def _kv_table(d: Dict[str, Any]) -> str:
    rows = "".join(f"<tr><th class='l'>{_e(k)}</th><td class='l'>{_e(v)}</td></tr>"
                   for k, v in d.items())
    return f"<table>{rows}</table>"


def _case_table(cases: List[Dict[str, Any]]) -> str:
    peers = any(c.get("peer_err") for c in cases)
    head = ["dtype", "kernel", "shape (B,H,Sq,Sk,D,Dv)", "causal", "max abs err", "rel err",
            "naive err", "threshold", "err/thr", "bound (max)", "err/bound", "lse err"]
    if peers:
        head += ["best peer", "err/peer"]
    head += ["result"]
    out = ["<table><tr>" + "".join(f"<th>{_e(h)}</th>" for h in head) + "</tr>"]
    for c in cases:
        mark = "*" if c.get("naive_kind") == "bound" else (
            "!" if not c.get("naive_informative", True) else "")
        cells = [c["dtype"], c["kernel"], c["shape"], "yes" if c["causal"] else "no",
                 _fmt(c["max_abs_err"]), _fmt(c["rel_err"]), _fmt(c["naive_err"]) + mark,
                 _fmt(c["threshold"]), _frac(c.get("frac_threshold")), _fmt(c.get("bound")),
                 _frac(c.get("frac_bound")), _fmt(c["lse_err"])]
        if peers:
            best = c.get("peer_best") or ""
            cells += [f"{best} {_fmt(c['peer_err'][best])}" if best else "n/a",
                      _frac(c.get("ratio_to_peer")) if best else ""]
        ok = c["result"] == "PASS"
        res = "<span class='pass'>PASS</span>" if ok else "<span class='fail-t'>FAIL</span>"
        tds = "".join(f"<td class='l'>{_e(x)}</td>" if i < 4 else f"<td>{_e(x)}</td>"
                      for i, x in enumerate(cells))
        title = "" if ok else f" title='{_e('; '.join(c.get('reasons', [])))}'"
        out.append(f"<tr class='{'' if ok else 'fail'}'{title}>{tds}<td>{res}</td></tr>")
    out.append("</table>")
    return "\n".join(out)


def _prop_table(props: List[Dict[str, Any]]) -> str:
    out = ["<table><tr><th class='l'>property</th><th class='l'>where</th><th>measured</th>"
           "<th>limit</th><th>result</th><th class='l'>detail</th></tr>"]
    for p in props:
        ok = p["result"] == "PASS"
        res = "<span class='pass'>PASS</span>" if ok else "<span class='fail-t'>FAIL</span>"
        out.append(f"<tr class='{'' if ok else 'fail'}'><td class='l'>{_e(p['name'])}</td>"
                   f"<td class='l'>{_e(p['where'])}</td><td>{_fmt(p['measured'])}</td>"
                   f"<td>{_fmt(p['limit'])}</td><td>{res}</td>"
                   f"<td class='l'>{_e(p.get('detail', ''))}</td></tr>")
    out.append("</table>")
    return "\n".join(out)


def _failures(cases, props, grads) -> str:
    """Every failed case, property and gradient case with its reasons, in view (the tables
    below are folded): "" when nothing failed."""
    items = []
    for c in cases:
        if c.get("result") != "PASS":
            items.append(f"{c['dtype']} {c['kernel']} {c['shape']} causal={c['causal']}: "
                         + "; ".join(c.get("reasons", [])))
    for p in props:
        if p.get("result") != "PASS":
            items.append(f"{p['name']} [{p['where']}]: {p.get('detail', '')}")
    for g in grads:
        if g.get("result") != "PASS":
            items.append(f"gradients {g['dtype']} {g['kernel']} {g['shape']} "
                         f"causal={g['causal']}: " + "; ".join(g.get("reasons", [])))
    if not items:
        return ""
    return ("<h2>Failures</h2><ul>" + "".join(f"<li class='fail-t'>{_e(x)}</li>" for x in items)
            + "</ul>")


def _mode(doc: Dict[str, Any]) -> str:
    """What ran: "standard", "standard (--quick)" or "file PATH"."""
    mode = str(doc.get("mode"))
    if mode == "file":
        return f"file {doc.get('file')}"
    return mode + (" (--quick)" if doc.get("quick") else "")


def write_report(directory: str, doc: Dict[str, Any]) -> str:
    """Write ``index.html`` and its PNG plots into ``directory`` (created if needed).

    Parameters
    ----------
    directory : str
    doc : dict
        The audit as :func:`cuflash._audit.to_json` returns it.

    Returns
    -------
    str
        The path of ``index.html``.
    """
    os.makedirs(directory, exist_ok=True)
    cases = list(doc.get("cases", []))
    props = list(doc.get("properties", []))
    grads = list((doc.get("gradients") or {}).get("cases", []))
    rng = np.random.default_rng([int(doc.get("seed") or 0), 16])
    figures, prop_figures = [], []   # (file, caption)
    if cases:
        _plot_cases(cases, os.path.join(directory, "cases_threshold.png"))
        figures.append(("cases_threshold.png", "Each case's error against its two bars."))
        _plot_fractions(cases, os.path.join(directory, "fractions.png"))
        figures.append(("fractions.png", "The error as a fraction of each bar, case by case."))
        if any(_dims(c["shape"]) for c in cases):
            _plot_seqlen(cases, os.path.join(directory, "error_vs_seqlen.png"))
            figures.append(("error_vs_seqlen.png",
                            "Error against the number of keys, per dtype and kernel."))
    if props:
        _plot_properties(props, os.path.join(directory, "properties.png"))
        prop_figures.append(("properties.png", "The property audits of this run."))
    _plot_chunk_order(os.path.join(directory, "prop_chunk_order.png"), rng)
    _plot_merge(os.path.join(directory, "prop_merge.png"), rng)
    _plot_overflow(os.path.join(directory, "prop_overflow.png"))
    _plot_alpha_underflow(os.path.join(directory, "prop_alpha_underflow.png"), rng)
    pictures = [("prop_chunk_order.png", "Chunk-order invariance: any chunking and order of the "
                 "keys gives softmax @ v to float64 rounding."),
                ("prop_merge.png", "The merge operator is associative and commutative to float64 "
                 "rounding."),
                ("prop_overflow.png", "Without the max subtraction, float16 exp(s) overflows "
                 "above s = 11.09; the recurrence never exponentiates a positive number."),
                ("prop_alpha_underflow.png", "A max jump of ~150 makes alpha = exp(-150) underflow "
                 "to 0 in float32; the earlier keys' weights are 0 to float32 anyway.")]

    s = doc.get("summary", {})
    n_fail = int(s.get("failed", 0))
    verdict = ("<span class='pass'>all passed</span>" if n_fail == 0 else
               f"<span class='fail-t'>{n_fail} failed</span>")
    dev = doc.get("device", {})
    parts = [
        "<!DOCTYPE html>", "<html lang='en'><head><meta charset='utf-8'>",
        "<title>cuflash-check report</title>", f"<style>{_CSS}</style></head><body>",
        "<h1>cuflash-check report</h1>",
        f"<p class='summary'>{verdict}: {_e(s.get('passed', 0))} passed, {n_fail} failed "
        f"({_e(s.get('cases', 0))} cases, {_e(s.get('properties', 0))} property audits, "
        f"{_e(s.get('gradient_cases', len(grads)))} gradient cases) on "
        f"{_e(dev.get('selected', '?'))} in {_e(doc.get('seconds', '?'))} s; mode "
        f"{_e(_mode(doc))}, seed {_e(doc.get('seed'))}, dtypes "
        f"{_e(', '.join(doc.get('dtypes', [])))}, peers "
        f"{_e(', '.join(doc.get('peers') or []) or 'none')}.</p>",
        _failures(cases, props, grads),
        "<h2>Device and versions</h2>", _kv_table(dev), "<p></p>",
        _kv_table(doc.get("versions", {})),
        "<h2>Cases</h2>",
    ]
    for name, caption in figures:
        parts.append(f"<figure><img src='{_e(name)}' alt='{_e(caption)}'>"
                     f"<figcaption>{_e(caption)}</figcaption></figure>")
    parts += ["<details><summary>The case table (hover a failed row for its reasons)</summary>",
              _case_table(cases), "</details>", "<h2>Properties of the recurrence</h2>"]
    for name, caption in prop_figures + pictures:
        parts.append(f"<figure><img src='{_e(name)}' alt='{_e(caption)}'>"
                     f"<figcaption>{_e(caption)}</figcaption></figure>")
    if props:
        parts.append(_prop_table(props))
    skipped = (doc.get("gradients") or {}).get("skipped")
    if skipped:
        parts += ["<h2>Gradients (attention_backward)</h2>",
                  f"<p>Not audited: {_e(skipped)}.</p>"]
    if grads:
        _plot_gradients(grads, os.path.join(directory, "gradients.png"))
        parts += ["<h2>Gradients (attention_backward)</h2>",
                  "<figure><img src='gradients.png' alt='gradient errors against thresholds'>"
                  "<figcaption>Each gradient case's dq, dk and dv error against its threshold."
                  "</figcaption></figure>",
                  "<details><summary>The gradient table</summary>", _grad_table(grads),
                  "</details>"]
    parts += ["<h2>Pass rule</h2>", f"<pre>{_e(doc.get('pass_rule', ''))}</pre>"]
    if grads and (doc.get("gradients") or {}).get("pass_rule"):
        parts += [f"<pre>{_e(doc['gradients']['pass_rule'])}</pre>"]
    parts += ["</body></html>"]
    path = os.path.join(directory, "index.html")
    with open(path, "w", encoding="utf-8") as fh:
        fh.write("\n".join(parts) + "\n")
    return path
