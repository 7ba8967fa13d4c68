"""The README's signature lines agree with the code: every parameter a line names exists with
the default it shows, and every parameter of the function is named somewhere in the README."""
import ast
import inspect
import re
from pathlib import Path

import pytest

import cuflash

README = (Path(__file__).resolve().parent.parent / "README.md").read_text()


def _functions():
    out = [("cuflash.attention", cuflash.attention),
           ("cuflash.attention_backward", cuflash.attention_backward)]
    try:
        import cuflash.jax as cj
    except ImportError:   # (JAX is an optional extra)
        return out
    return out + [("cuflash.jax.attention", cj.attention)]


def _documented(name):
    """The README's signature line of `name` as {parameter: default or inspect._empty}."""
    lines = [m.group(1) for m in re.finditer(r"^`" + re.escape(name) + r"\((.*)\)`", README,
                                             re.MULTILINE)]
    assert len(lines) == 1, f"the README has {len(lines)} signature lines for {name}"
    params = {}
    for part in (p.strip() for p in lines[0].split(",")):
        if part in ("*", ""):
            continue
        key, eq, default = part.partition("=")
        params[key.strip()] = ast.literal_eval(default.strip()) if eq else inspect.Parameter.empty
    return params


@pytest.mark.parametrize("name, fn", _functions(), ids=[n for n, _ in _functions()])
def test_signature_lines_match_the_code(name, fn):
    real = inspect.signature(fn).parameters
    for key, default in _documented(name).items():
        assert key in real, f"README's {name} names {key!r}, which the function does not take"
        assert real[key].default == default, \
            f"README's {name} shows {key}={default!r}, the function's default is {real[key].default!r}"
    for key in real:
        assert re.search(r"`[^`]*\b" + re.escape(key) + r"\b[^`]*`", README), \
            f"{name}'s parameter {key!r} appears nowhere in the README"
