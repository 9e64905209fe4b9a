"""Property (hypothesis): any Unicode string or number in any spec string/number field (every field of
every record, table names included) either fails the load with one `file:line: message` (no traceback,
no other exception), or stays data: the value lies in its field's declared domain, every path the
generator and the cache would write stays one plain component under its root, and a free-text value
reaches the rendered sources only inside a `//` comment, on one line. Nothing is compiled here."""

import copy
import math
import os
import re
import shutil
import tomllib
from pathlib import Path

import attrs
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from generator import render
from generator import spec_schema as schema
from generator import specs as S
from generator.cache import Entry
from generator.model import enumerate_variants
from tests.support.spec_edit import LOCATED

ROOT = Path(__file__).resolve().parents[2]
SETTINGS = settings(max_examples=100, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

# One table of each record kind (file, key path; an int picks an element of an array of tables), and
# the variant namespace its name matches (None: the record reaches no variant's own facts).
RECORDS = {
    S.Target: ("targets", ("target", "gfx950"), "target"),
    S.Toolchain: ("targets", ("toolchain", "amd"), None),
    S.DType: ("dtypes", ("dtype", "fp8_e4m3fn"), "wire"),
    S.Quant: ("quant", ("quant", "fp8_blockwise"), "quant"),
    S.Topology: ("topologies", ("topology", "intranode"), "topology"),
    S.Family: ("kernels", ("family", "quantize_fp8"), "family"),
    S.Rule: ("rules", ("rule", 0), None),
    S.Profile: ("profiles", ("profile", "runtime"), None),
    S.Bucket: ("tuning", ("tuning", "sm_90", "dispatch", 0), None),
}
NOT_IN_FILES = {(S.Rule, "where"), (S.Family, "limits_of")}  # filled in by the loader


def _fields():
    out = []
    for cls in RECORDS:
        attrs.resolve_types(cls)
        for f in attrs.fields(cls):
            if (cls, f.name) in NOT_IN_FILES:
                continue
            if f.name == "name" and cls is not S.Rule:
                out.append((cls, "name", "name"))  # the table's own key
            elif f.type is bool:
                out.append((cls, f.name, "flag"))
            elif f.type in (int, float):
                out.append((cls, f.name, "number"))
            elif f.type is str:
                out.append((cls, f.name, "text"))
            elif f.type.__args__[0] is str:
                out.append((cls, f.name, "list"))
            else:
                out.append((cls, f.name, "map"))
    return out


FIELDS = _fields()

# ---------------------------------------------------------------------------------------------
# Writing TOML (the test changes parsed data, then writes the whole file again)
# ---------------------------------------------------------------------------------------------
def _str(s):
    body = "".join("\\" + c if c in '"\\' else f"\\u{ord(c):04x}" if ord(c) < 0x20 or ord(c) == 0x7F else c
                   for c in s)
    return f'"{body}"'


def _key(k):
    return k if re.fullmatch(r"[A-Za-z0-9_-]+", k) else _str(k)


def _value(v):
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, str):
        return _str(v)
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf") if math.isinf(v) else repr(v)
    if isinstance(v, list):
        return "[" + ", ".join(map(_value, v)) + "]"
    return "{ " + ", ".join(f"{_key(k)} = {_value(x)}" for k, x in v.items()) + " }"


def _is_tables(v):
    return isinstance(v, list) and bool(v) and all(isinstance(x, dict) for x in v)


def _emit(out, path, table, in_array=False):
    subs = []
    for k, v in table.items():
        if (isinstance(v, dict) and len(path) < 2 and not in_array) or _is_tables(v):
            subs.append((k, v))
        else:
            out.append(f"{_key(k)} = {_value(v)}")
    for k, v in subs:
        head = ".".join(map(_key, path + (k,)))
        for el in (v if isinstance(v, list) else [v]):
            out.append(f"[[{head}]]" if isinstance(v, list) else f"[{head}]")
            _emit(out, path + (k,), el, isinstance(v, list))


def dumps(data):
    out = []
    _emit(out, (), data)
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------------------------------------
# Values
# ---------------------------------------------------------------------------------------------
SEEDS = ["", "x", "gfx950", "amd", "nvidia", "hip", "cu", "hsaco", "nvcc", "clang++-22", "hipcc", "python3",
         "/bin/sh", "../x", "hip/../../../../tmp/x", ".hidden", "-x", "a\\", "a??/", "kernels/quantize.j2",
         "variant.j2", "kernels/../variant.j2", "x\u2029#error injected", "x\u2028static int injected = 1;",
         "x\x85y", "x\ny", "*/ int injected; /*", "{{ 7 * 7 }}", "{% include 'variant.j2' %}",
         "__import__('os').system('id')", "fp8_encode", "-O3", "-o/tmp/x", "ocp", "fnuz", "float", "fp8",
         "fp4", "none", "e8m0", "fp32", "wave", "block", "intranode", "internode", "convert", "dispatch", "bf16",
         "same", "target.vendor", "gfx950\n", "quantize_fp8\n", "v_cvt_pk_fp8_f32", "llvm-objdump-22"]
TEXT = st.one_of(st.text(), st.text(st.characters(codec="ascii"), max_size=12), st.sampled_from(SEEDS),
                 st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,12}", fullmatch=True))
NUMBER = st.one_of(st.integers(-2**63, 2**63 - 1), st.floats(),
                   st.sampled_from([0, 1, -1, 4, 8, 16, 32, 48, 64, 128, 256, 512, 1024, 2**31, 2**63 - 1,
                                    0.0, 100.25, 240.0, 448.0, 5e-324, 1e300]))
VALUES = {
    "name": TEXT,
    "text": TEXT,
    "number": NUMBER,
    "flag": st.one_of(st.booleans(), NUMBER, TEXT),  # true / false, or what a flag must not be
    "list": st.tuples(st.booleans(), st.lists(TEXT, max_size=3)),  # (append to the list?, strings)
    "map": st.dictionaries(TEXT, st.one_of(TEXT, st.lists(TEXT, max_size=2)), max_size=2),
}


def _table(data, path):
    for k in path:
        data = data[k]
    return data


def _apply(datas, cls, field, kind, value):
    """The spec files' data with the value put into the field of the representative table."""
    file, path, _ = RECORDS[cls]
    datas = copy.deepcopy(datas)
    table = _table(datas[file], path)
    if kind == "name":  # a copy of the table under the new name (a target brings its tuning along)
        _table(datas[file], path[:-1])[value] = copy.deepcopy(table)
        if cls is S.Target:
            datas["tuning"]["tuning"][value] = copy.deepcopy(datas["tuning"]["tuning"][path[-1]])
        return datas, {file, "tuning"} if cls is S.Target else {file}
    if kind == "list":
        append, items = value
        table[field] = (table.get(field, []) if append else []) + items
    elif kind == "map":
        table[field] = {**table.get(field, {}), **value}
    else:
        table[field] = value
    return datas, {file}


# ---------------------------------------------------------------------------------------------
# The property
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """A spec folder whose files are written from parsed data, the data, and the renders of the specs."""
    root = tmp_path_factory.mktemp("spec_props")
    shutil.copytree(ROOT / "specs", root / "specs")
    datas = {n: tomllib.loads((root / "specs" / f"{n}.toml").read_text()) for n in S.SPEC_FILES}
    for n, data in datas.items():  # the writer round-trips every spec file
        assert tomllib.loads(dumps(data)) == data, n
        (root / "specs" / f"{n}.toml").write_text(dumps(data))
    env = render.environment()
    base = {v.key: v for v in enumerate_variants(S.load(root / "specs"), S.load().targets, "all")[0]}
    return root, datas, env, base, {}


def _located_one_line(err, root):
    text = str(err)
    m = LOCATED.fullmatch(text)
    assert m and len(text.splitlines()) == 1, text
    path = Path(m["file"])
    path = path if path.is_absolute() else Path.cwd() / path
    assert path.parent.resolve() == (root / "specs").resolve() and path.suffix == ".toml", text
    assert 1 <= int(m["line"]) <= len(path.read_text().split("\n")), text


def _strings(value):
    if isinstance(value, str):
        return [value]
    if isinstance(value, tuple):
        return list(value[1])
    if isinstance(value, dict):
        return [s for k, v in value.items() for s in [k, *([v] if isinstance(v, str) else v)]]
    return []


def _in_domain(cls, field, kind, value):
    for s in _strings(value):
        assert all(c.isprintable() for c in s) and len(f"a{s}a".splitlines()) == 1, s
    if kind == "name":
        assert schema._IDENT.fullmatch(value), value
    form = schema._PATTERNS.get((cls, field))
    for s in _strings(value) if kind != "map" else list(value):
        assert form is None or form[0].fullmatch(s), s
        assert (cls, field) not in schema._CHOICES or s in schema._CHOICES[(cls, field)], s
    if kind == "flag":
        assert isinstance(value, bool), value
    if kind == "number":
        rng, choices = schema._RANGES.get((cls, field)), schema._CHOICES.get((cls, field))
        assert (rng and rng.admits(value)) or (choices and value in choices), value


def _under(root, folder, name):
    """root/folder/name normalises to exactly that: two plain components under root (none of it exists
    here, so there is no link to follow)."""
    p = os.path.normpath(os.path.join(root, folder, name))
    assert p == f"{root}{os.sep}{folder}{os.sep}{name}", (root, folder, name)


def _rendered_as_comment(text, base, value):
    lines, base_lines = text.split("\n"), base.split("\n")
    assert len(lines) == len(base_lines)  # no line added: nothing broke out of its comment
    for line, old in zip(lines, base_lines):
        if line != old:
            same = next((i for i, (a, b) in enumerate(zip(line, old)) if a != b), min(len(line), len(old)))
            assert "//" in line[:same], (line, value)  # the change starts inside a comment
            assert value.rstrip() in line, (line, value)  # rendering strips trailing spaces


def _check(work, cls, field, kind, value):
    root, datas, env, base, base_renders = work
    file, path, ns = RECORDS[cls]
    changed, files = _apply(datas, cls, field, kind, value)
    try:
        for n in files:
            (root / "specs" / f"{n}.toml").write_text(dumps(changed[n]))
        try:
            specs = S.load(root / "specs")
        except S.SpecError as e:
            _located_one_line(e, root)
            return "rejected"
        _in_domain(cls, field, kind, value)
        # the representative tables reach the variants of gfx950 (a new target: its own)
        variants, _ = enumerate_variants(specs, [value if cls is S.Target and kind == "name" else "gfx950"], "all")
        out_root, cache_root = str(root / "generated"), str(root / "cache")
        for v in variants:
            _under(out_root, v.target.name, v.file)
        for v in {v.target.name: v for v in variants}.values():  # the cache's names: per target
            entry = Entry.of(Path(cache_root), v, "0" * 64)
            for p in (entry.artifact, entry.record, entry.artifact.with_suffix(".lock")):
                _under(cache_root, v.target.name, p.name)
        name = value if kind == "name" else path[-1]
        mine = [v for v in variants if ns and getattr(v, ns) is not None and getattr(v, ns).name == name]
        for v in {v.key: v for v in mine[:1] + mine[-1:]}.values():
            text = render.render(v, env)
            if kind == "text" and (cls, field) not in schema._CHOICES and (cls, field) not in schema._PATTERNS:
                if v.key not in base_renders:
                    base_renders[v.key] = render.render(base[v.key], env)
                _rendered_as_comment(text, base_renders[v.key], value)
        return "accepted"
    finally:
        for n in files:
            (root / "specs" / f"{n}.toml").write_text(dumps(datas[n]))


@pytest.mark.parametrize("cls,field,kind", FIELDS, ids=[f"{c.__name__}.{f}" for c, f, _ in FIELDS])
def test_spec_values_fail_located_or_stay_data(work, property_stats, cls, field, kind):
    outcomes = set()

    @SETTINGS
    @given(value=VALUES[kind])
    def prop(value):
        outcomes.add(_check(work, cls, field, kind, value))
        property_stats["spec field values tried"] += 1

    prop()
    assert "rejected" in outcomes or kind == "map"  # every field has values that fail the load


def test_every_spec_field_is_drawn():
    drawn = {(c, f) for c, f, _ in FIELDS}
    for cls in RECORDS:
        for f in attrs.fields(cls):
            assert (cls, f.name) in drawn or (cls, f.name) in NOT_IN_FILES, (cls.__name__, f.name)
