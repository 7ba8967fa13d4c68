"""The README's signature lines agree with the code: every parameter a line names exists with
the default it shows, and every parameter of the function is named somewhere in the README."""
import ast
import inspect
import os
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


DOCS = [README] + [p.read_text() for p in sorted(
    (Path(__file__).resolve().parent.parent / "notes").glob("*.md"))] + [
    (Path(__file__).resolve().parent.parent / "benchmarks" / "README.md").read_text()]


def test_every_flag_the_docs_name_exists():
    """Every ``_module.NAME`` (an upper-case attribute of a cuflash module) named in README.md,
    notes/*.md and benchmarks/README.md exists: a renamed or removed flag leaves no stale doc."""
    import importlib

    named = {m.groups() for doc in DOCS
             for m in re.finditer(r"\b(_[a-z_]+)\.([A-Z][A-Z0-9_]+)\b", doc)}
    assert len(named) > 10
    missing = []
    for mod, name in sorted(named):
        try:
            found = hasattr(importlib.import_module(f"cuflash.{mod}"), name)
        except ImportError:
            found = False
        if not found:
            missing.append(f"cuflash.{mod}.{name}")
    assert not missing, f"the docs name flags that do not exist: {missing}"


def test_flags_are_where_the_readme_says():
    """README's "What has run on a GPU" names the flags switched on after the GPU suite passed
    with them and those that stay off: changing one must come with the README's change."""
    from conftest import FLAGS_SET
    from cuflash import _callcache, _decode, _dispatch_variants, _varlen

    if FLAGS_SET:
        pytest.skip(f"flags set by --cuflash-flag: {FLAGS_SET}")
    on = README[README.index("Switched on\nafter it:"):README.index("These stay off:")]
    for name in ("_decode.DECODE_VERSION = 8", "_decode.DECODE_SPLIT_RULE = 4",
                 "VARLEN_DENSE_AUTO", "VARLEN_HOPPER_AUTO", "VARLEN_HOPPER_GROUP = 4",
                 "ALIBI_AFFINE", "direct launch"):
        assert name in on, name
    assert _decode.DECODE_VERSION == 8 and _decode.DECODE_SPLIT_RULE == 4
    assert _varlen.VARLEN_DENSE_AUTO and _varlen.VARLEN_HOPPER_AUTO
    assert _varlen.VARLEN_HOPPER_GROUP == 4
    assert _dispatch_variants.ALIBI_AFFINE
    off = README[README.index("These stay off:"):README.index("`benchmarks/run_gpu_suite.sh`")]
    assert "VARIANT_FUSED_SCALE" in on and "SOFTCAP_RCP_FMA" in off
    assert _dispatch_variants.VARIANT_FUSED_SCALE and not _dispatch_variants.SOFTCAP_RCP_FMA
    assert "DECODE_SPLIT_RULE = 3" in off
    assert "FAST_EMPTY" in on
    if os.environ.get("CUFLASH_FAST_EMPTY", "1") != "0":
        assert _callcache.FAST_EMPTY
    if os.environ.get("CUFLASH_DIRECT_LAUNCH", "1") != "0":
        assert _callcache.DIRECT_LAUNCH
