"""``cuflash-check``: audit cuflash's attention against a float64 SciPy reference.

This module is only the click command; the grid, the cases, the property audits and the
formatting live in :mod:`cuflash._audit`.
"""
from __future__ import annotations

import json
import os
import sys
import time

import click

HELP = """Audit cuflash.attention against a float64 SciPy reference.

Without FILE, run the standard audit: a grid of shapes (Sq, Sk up to 1000, head dims 1 to
256, D != Dv, causal on and off) in every dtype of the device and through every kernel the
dispatcher can pick (on a GPU also the generic audit kernel when "auto" picks another one),
followed by property audits of the online-softmax recurrence and of the merge operator.
Inputs are random, from numpy.random.default_rng([SEED, shape index]); the seed is printed.

With FILE (an .npz holding arrays q, k, v and optionally the scalars causal (bool) and scale
(float) and the upstream gradient do (o's shape), and no other array: an unknown name is a
usage error), audit that single problem in the file's dtype, or in each --dtype given, and
with do the gradients of attention_backward too (not when q, k, v or do hold NaN/inf, which
the float64 reference gradients do not carry: the output says so). --seed and --quick do not
apply to a FILE. The standard audit has a gradient section of its own grid.

Pass rule. {rule}

{grad_rule}

Exit status: 0 only when every case, property and gradient case passes, 1 when any fails, 2
for usage errors (no GPU for --device gpu, a bad --seed, an unreadable FILE, a missing or
unknown array, shapes cuflash rejects, an unwritable --json or --report path) and when the
--json or --report output cannot be written at the end (the verdict is printed first).
"""


class _InputError(click.ClickException):
    """An error in what the audit was asked to do; exit status 2 like click's usage errors."""

    exit_code = 2


def _help() -> str:
    # click re-wraps each paragraph of the text, PASS_RULE's included.
    from cuflash._audit import PASS_RULE
    from cuflash._audit_grad import GRAD_RULE
    return HELP.replace("{rule}", PASS_RULE).replace("{grad_rule}", GRAD_RULE)


def _check_writable(path: str, what: str) -> None:
    """Fail now, with exit status 2, if ``path`` (a file to be written at the end) cannot be
    created: better than a traceback after the whole audit has run."""
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise _InputError(f"{what} {path}: directory {parent} does not exist")
    existed = os.path.exists(path)
    try:
        with open(path, "a", encoding="utf-8"):
            pass
    except OSError as exc:
        raise _InputError(f"{what} {path}: cannot write it ({exc.strerror})") from None
    if not existed:
        os.remove(path)


def _check_report_dir(path: str) -> None:
    """--report DIR: matplotlib must be importable and DIR creatable and writable, checked
    before the audit runs."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise _InputError("--report needs matplotlib, which is not installed "
                          "(pip install \"cuflash[report]\")") from None
    if os.path.exists(path) and not os.path.isdir(path):
        raise _InputError(f"--report {path}: exists and is not a directory")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise _InputError(f"--report {path}: cannot create it ({exc.strerror})") from None
    if not os.access(path, os.W_OK):
        raise _InputError(f"--report {path}: the directory is not writable")


def _parse_seed(text):
    """--seed: a non-negative integer (numpy.random.default_rng takes no negative seed)."""
    try:
        seed = int(text)
    except ValueError:
        seed = -1
    if seed < 0:
        raise click.BadParameter(f"expected a non-negative integer or 'random', got {text!r}",
                                 param_hint="--seed")
    return seed


class _Progress:
    """Progress that also works in logs: on a terminal, a line on stderr redrawn in place (and
    cleared while a table row is printed); otherwise, a plain line every ``every`` seconds."""

    def __init__(self, total: int, every: float):
        self.total, self.every = total, every
        self.done = self.cases = self.failed = 0
        self.t0 = self.last = time.perf_counter()
        self.tty = sys.stdout.isatty() and sys.stderr.isatty()

    def _text(self) -> str:
        return (f"auditing: {self.done}/{self.total} shapes, {self.cases} cases, "
                f"{self.failed} failed, {time.perf_counter() - self.t0:.0f} s")

    def _draw(self):
        if self.tty:
            width = 30
            fill = int(width * self.done / max(1, self.total))
            sys.stderr.write(f"\r[{'#' * fill}{'.' * (width - fill)}] {self._text()}\033[K")
            sys.stderr.flush()

    def result(self, line: str, passed: bool):
        """Print a table row as its case is judged."""
        self.cases += 1
        self.failed += not passed
        if self.tty:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()
        click.echo(line)
        self._draw()

    def step(self, n: int = 1):
        self.done += n
        now = time.perf_counter()
        if self.tty:
            self._draw()
        elif now - self.last >= self.every:
            self.last = now
            click.echo(self._text(), err=True)

    def close(self):
        if self.tty:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()
        elif self.total:
            click.echo(self._text() + " (done)", err=True)


@click.command(help=_help(), context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("file", required=False, type=click.Path(dir_okay=False))
@click.option("--device", "device_name", type=click.Choice(["auto", "cpu", "gpu"]),
              default="auto", show_default=True,
              help="Where to run: auto picks the GPU when cuflash.gpu_available(), else the "
                   "NumPy path, and says why.")
@click.option("--dtype", "dtypes", multiple=True,
              type=click.Choice(["float16", "bfloat16", "float32", "float64"]),
              help="Restrict (or, with FILE, cast) to these dtypes; repeat for several. "
                   "Default: float16, bfloat16 (with ml_dtypes), float32, float64.")
@click.option("--seed", default="0", show_default=True,
              help="Seed of the random inputs (an integer >= 0), or 'random' for a fresh one "
                   "(printed; passing it back with --seed reproduces the run). A fixed "
                   "default makes the standard audit reproducible run to run.")
@click.option("--quick", is_flag=True, help="A small subset of the grid (seconds).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False),
              help="Also write every result, the device, versions, the seed, the mode "
                   "(standard, --quick, file), the peers and the exit status as JSON.")
@click.option("--report", "report_dir", type=click.Path(file_okay=False),
              help="Also write a self-contained HTML report with PNG plots into this directory "
                   "(created if needed; needs matplotlib: pip install cuflash[report]).")
@click.option("--peers/--no-peers", default=True, show_default=True,
              help="Also measure the SDPA of PyTorch and JAX on the same inputs, where they "
                   "can be imported, and report cuflash's error over the best of them.")
@click.option("--progress-every", type=float, default=5.0, show_default=True,
              help="Seconds between progress lines when stdout is not a terminal (a log).")
def main(file, device_name, dtypes, seed, quick, json_path, report_dir, peers, progress_every):
    from cuflash import _audit, _audit_grad

    t0 = time.perf_counter()
    # FILE mode draws nothing: its seed is None. Checked before anything is printed or run.
    seed = None if file is not None else (
        _audit.new_seed() if seed == "random" else _parse_seed(seed))
    if json_path:
        if file is not None and os.path.exists(file) and os.path.exists(json_path) \
                and os.path.samefile(file, json_path):
            raise _InputError(f"--json {json_path} is FILE itself: writing the results would "
                              "overwrite the inputs")
        _check_writable(json_path, "--json")
    if report_dir:
        _check_report_dir(report_dir)
    try:
        device, reason = _audit.select_device(device_name)
        # With FILE and no --dtype, the file's own dtype is audited.
        dtypes = _audit.resolve_dtypes(device, dtypes) if dtypes or file is None else []
    except _audit.AuditError as exc:
        raise _InputError(str(exc)) from None
    click.echo(f"device: {device.name} ({reason})")
    if device.name == "cpu" and device_name == "auto":
        detail = _audit.no_gpu_detail()
        if detail:
            click.echo(f"        detail: {detail}")
    peer_names = _audit.available_peers() if peers else []
    if peer_names:
        click.echo(f"peers: {', '.join(peer_names)} (their SDPA on the same inputs; --no-peers "
                   "to skip)")

    props, grads, grads_skipped = [], [], ""
    table = _audit.CaseTable(peers=bool(peer_names))
    if file is None:
        mode = "standard"
        shapes = _audit.standard_grid(quick)
        click.echo(f"seed: {seed}   dtypes: {', '.join(dtypes)}   "
                   f"{len(shapes)} shapes{' (--quick)' if quick else ''}")
        click.echo("")
        click.echo(table.header())
        progress = _Progress(len(shapes), progress_every)
        try:
            cases = _audit.run_grid(device, shapes, dtypes, seed, progress=progress.step,
                                    on_result=lambda r: progress.result(table.row(r), r.passed),
                                    peers=peer_names)
        finally:
            progress.close()
        click.echo(_audit.case_footnotes(cases).lstrip("\n"))
        click.echo("")
        click.echo("property audits (recurrence, merge, overflow, underflow, variants) ...")
        props = _audit.property_audits(device, dtypes, seed)
        click.echo("gradient audits (attention_backward: dq, dk, dv) ...")
        grads = _audit_grad.run_grid(device, dtypes, seed, quick)
    else:
        mode = "file"
        try:
            inp, dtypes = _audit.load_npz(file, dtypes)
            if inp.exact == "raw":
                _audit.preflight(inp, file)
            click.echo(f"file: {file}   q {inp.q.shape}, k {inp.k.shape}, v {inp.v.shape}   "
                       f"causal={inp.causal}   scale={'default' if inp.scale is None else inp.scale}"
                       f"   dtypes: {', '.join(dtypes)}")
            note = _audit.nonfinite_note(inp)
            if note:
                click.echo(note)
            cases = _audit.run_inputs(device, inp, dtypes, raise_call_errors=True,
                                      peers=peer_names)
            ginp, gdtypes = _audit_grad.inputs_from_npz(file, dtypes)
            grads_skipped = "" if ginp is None else _audit_grad.nonfinite_reason(ginp)
            if grads_skipped:
                click.echo(f"gradients: not audited: {grads_skipped}")
            elif ginp is not None:
                grads = _audit_grad.run_inputs(device, ginp, gdtypes, raise_call_errors=True)
        except _audit.AuditError as exc:
            raise _InputError(str(exc)) from None
        except (ValueError, TypeError) as exc:
            raise _InputError(f"{file}: {exc}") from None
        click.echo("")
        click.echo(_audit.format_cases(cases))

    if props:
        click.echo("")
        click.echo(_audit.format_properties(props))
    if grads:
        click.echo("")
        click.echo(_audit_grad.format_cases(grads))
    failures = "\n".join(f for f in (_audit.format_failures(cases, props),
                                     _audit_grad.format_failures(grads)) if f)
    if failures:
        click.echo("")
        click.echo(failures)

    n_all = len(cases) + len(props) + len(grads)
    n_pass = sum(r.passed for r in cases) + sum(p.passed for p in props) + \
        sum(g.passed for g in grads)
    elapsed = time.perf_counter() - t0
    status = 0 if n_pass == n_all else 1
    doc = _audit.to_json(device=device, reason=reason, seed=seed, mode=mode, cases=cases,
                         props=props, dtypes=dtypes, file=file, seconds=elapsed, quick=quick,
                         peers=peer_names)
    doc["gradients"] = _audit_grad.to_json(grads, grads_skipped)
    doc["summary"] = {**doc["summary"], "passed": n_pass, "failed": n_all - n_pass,
                      "gradient_cases": len(grads)}
    doc["exit_status"] = status
    # A write that fails now (a full disk, a path gone since the checks up front) is said after
    # the verdict, with exit status 2: not a traceback, and not 1, which would claim a failure.
    unwritten = []
    if json_path:
        try:
            with open(json_path, "w", encoding="utf-8") as fh:
                json.dump(doc, fh, indent=2, allow_nan=False)
                fh.write("\n")
        except OSError as exc:
            unwritten.append(f"--json {json_path}: cannot write it ({exc.strerror or exc})")
    if report_dir:
        from cuflash import _report

        try:
            index = _report.write_report(report_dir, doc)
            click.echo("")
            click.echo(f"report: {index}")
        except OSError as exc:
            unwritten.append(f"--report {report_dir}: cannot write it ({exc.strerror or exc})")
    click.echo("")
    click.echo(f"elapsed: {elapsed:.1f} s")
    click.echo(f"{n_pass} passed, {n_all - n_pass} failed")
    for line in unwritten:
        click.echo(f"Error: {line}", err=True)
    sys.exit(2 if unwritten else status)


if __name__ == "__main__":  # pragma: no cover
    main()
