"""Launch arguments declared once (specs/kernels.toml [args.NAME]): every rendered kernel's parameter list is its
family's declaration on every target, the runtime's argument block follows the same declaration by name, and
a missing, unknown or mistyped argument is an error naming the family and the argument before any launch."""

import ctypes
import re
import types

import pytest
import torch

from generator import render as R
from generator import specs as S
from generator.model import enumerate_variants
from runtime import kernels
from runtime.errors import LaunchError
from tests.support.spec_edit import line_of, mutate

_C_TYPES = {"int": "i32", "float": "f32", "char": "char", "void": "void"}


def _parameters(source: str, symbol: str) -> list[tuple[str, str]]:
    """(type, name) of each parameter of the kernel `symbol` in a rendered source, in the declaration's spelling."""
    m = re.search(rf"EPG_KERNEL void {symbol}\(([^)]*)\)", source)
    assert m, f"no kernel {symbol}"
    out = []
    for param in (p.strip() for p in m.group(1).split(",")):
        pm = re.fullmatch(r"(const )?(\w+)(\*)? *(?:__restrict__ )?(\w+)", param)
        assert pm, param
        const, ctype, star, name = pm.groups()
        if not star:
            out.append(("i64" if ctype == "epg_i64" else ctype, name))
        else:
            out.append((f"{const or ''}{_C_TYPES[ctype]}*", name))
    return out


def _struct_fields(source: str, struct: str) -> list[str]:
    m = re.search(rf"struct {struct} \{{(.*?)\n\}};", source, re.S)
    assert m, f"no struct {struct}"
    return re.findall(r"epg_i64 (\w+);", m.group(1))


@pytest.fixture(scope="module")
def every_variant():
    specs = S.load()
    variants, _ = enumerate_variants(specs, list(specs.targets), "all")
    return specs, variants


def test_every_family_declares_its_arguments(every_variant):
    specs, variants = every_variant
    assert {f.args for f in specs.families.values()} <= set(specs.arglists)
    assert {v.family.name for v in variants} == set(specs.families)  # every family has variants to check
    assert {v.target.name for v in variants} == set(specs.targets)


def test_rendered_signatures_are_the_declarations(every_variant):
    """For every family on every target: the rendered kernel takes exactly its declared arguments, in order, with
    their declared types (a struct list: the one struct by value, its fields in order)."""
    _, variants = every_variant
    env = R.environment()
    for v in variants:
        src = R.render(v, env)
        sig = v.family.signature
        params = _parameters(src, v.symbol)
        if sig.struct:
            assert params == [(sig.struct, "a")], v.key
            assert _struct_fields(src, sig.struct) == [f.name for f in sig.fields], v.key
        else:
            assert params == [(f.type, f.name) for f in sig.fields], v.key


def test_a_hand_written_signature_is_caught(every_variant):
    """The check above can fail: a kernel whose template spells its own parameter list (two arguments swapped)."""
    _, variants = every_variant
    v = next(v for v in variants if v.family.name == "grouped_reduce")
    src = R.render(v)
    swapped = src.replace("epg_i64 k,\n    epg_i64 hidden", "epg_i64 hidden,\n    epg_i64 k")
    assert swapped != src
    assert _parameters(swapped, v.symbol) != [(f.type, f.name) for f in v.family.signature.fields]


def test_shared_limits_are_rendered_from_the_spec(every_variant):
    specs, variants = every_variant
    limits = specs.arglists["grouped_place"]
    assert limits.limit("max_experts") == 1024
    # the standalone placement and every EP kernel that runs the layout's passes (grouped_tail.j2) size their
    # shared memory from the one declaration (dispatch_ll runs none: dispatch_ll_tail does)
    users = [v for v in variants if v.family.args == "grouped_place" or v.family.name in (
        "dispatch", "dispatch_ll_tail", "combine_gather", "combine_ll")]
    assert {v.family.name for v in users} >= {"grouped_place", "dispatch", "dispatch_ll_tail"}
    for v in users:
        src = R.render(v)
        assert f"constexpr int EPG_GROUPED_MAX_EXPERTS = {limits.limit('max_experts')};" in src
        assert f"constexpr int EPG_GROUPED_MAX_THREADS = {limits.limit('max_threads')};" in src
        assert "int wave_sums[EPG_GROUPED_MAX_THREADS / EPG_WAVE];" in src
        assert f"constexpr int EPG_GROUPED_SMALL_PAIRS = {limits.limit('small_pairs')};" in src


def test_grouped_reduce_small_form_fits_the_runtime_block(every_variant):
    """grouped_reduce takes its small-batch form only in blocks of pair_slots x small_items threads: the runtime's
    block (runtime/backends/native.py BLOCK) must be that, or the form would never run (and say nothing)."""
    from runtime.backends.native import BLOCK

    specs, variants = every_variant
    red = specs.arglists["grouped_reduce"]
    assert red.limit("pair_slots") * red.limit("small_items") == BLOCK
    src = R.render(next(v for v in variants if v.family.name == "grouped_reduce"))
    assert f"constexpr int EPG_REDUCE_SLOTS = {red.limit('pair_slots')};" in src
    assert f"constexpr int EPG_REDUCE_ITEMS = {red.limit('small_items')};" in src


def test_struct_mirror_follows_the_declaration():
    sig = S.load().arglists["ep"]
    st = kernels.struct_type(sig)
    assert [f for f, _ in st._fields_] == [f.name for f in sig.fields] and ctypes.sizeof(st) == 8 * len(sig.fields)
    assert kernels.struct_type(sig) is st  # one type per declaration
    with pytest.raises(LaunchError, match=r"\[args.grouped_place\] is not a struct"):
        kernels.struct_type(S.load().arglists["grouped_place"])


class _Raw:
    """A stand-in code object: records the argument block the driver would copy."""
    symbol, max_threads = "epg_fake", 1024

    def __init__(self):
        self.calls = []

    def launch_params(self, grid, block, params):
        n = len(params)
        self.calls.append((grid, block, [ctypes.c_int64.from_address(params[i]).value for i in range(n)]))
        return 7

    def launch(self, grid, block, *args):
        self.calls.append((grid, block, args))
        return 7


def _kernel(family: str):
    specs = S.load()
    fam = specs.families[family]
    variant = types.SimpleNamespace(family=fam, converts=False)
    return kernels.Kernel(_Raw(), variant)


def _grouped_reduce_args():
    return dict(expert_out=torch.zeros(4, dtype=torch.bfloat16), pair_pos=torch.zeros(4, dtype=torch.int32),
                recv_w=torch.zeros(4), total_recv=torch.zeros(1, dtype=torch.int32),
                out=torch.zeros(4, dtype=torch.bfloat16), k=8, hidden=7168, apply_weights=1, pair_w=None,
                out_w=torch.zeros(4))


def test_launch_builds_the_block_by_name(monkeypatch):
    monkeypatch.setattr(kernels, "on_gpu", lambda t: True)
    kern = _kernel("grouped_reduce")
    args = _grouped_reduce_args()
    assert kern.launch(3, 256, **dict(reversed(args.items()))) == 7  # keyword order does not matter
    grid, block, values = kern.raw.calls[-1]
    order = [f.name for f in kern.signature.fields]
    expect = [args[n].data_ptr() if isinstance(args[n], torch.Tensor) else 0 if args[n] is None else args[n]
              for n in order]
    assert expect.count(0) == 1  # the optional pair_w left out: address 0
    assert (grid, block, values) == (3, 256, expect)


@pytest.mark.parametrize("change, message", [
    (dict(k=None), "argument 'k' is missing"),
    (dict(stride=4), "argument 'stride' is not declared"),
    (dict(k=8.0), "argument 'k' must be an int, got float"),
    (dict(k=True), "argument 'k' must be an int, got bool"),
    (dict(hidden=torch.tensor(7168)), "argument 'hidden' must be an int, got Tensor"),
    (dict(hidden=1 << 63), "argument 'hidden' = 9223372036854775808 does not fit in 64 bits"),
    (dict(pair_pos=5), "argument 'pair_pos' must be a tensor, got int"),
    (dict(pair_pos=None), "argument 'pair_pos' is required"),
    (dict(pair_pos=torch.zeros(4, dtype=torch.int64)), "argument 'pair_pos' must be a torch.int32 tensor, got torch.int64"),
    (dict(recv_w=torch.zeros(4, dtype=torch.bfloat16)), "argument 'recv_w' must be a torch.float32 tensor"),
])
def test_launch_refuses_a_wrong_argument(monkeypatch, change, message):
    monkeypatch.setattr(kernels, "on_gpu", lambda t: True)
    kern = _kernel("grouped_reduce")
    args = {**_grouped_reduce_args(), **change}
    args = {n: v for n, v in args.items() if not (n == "k" and v is None)}
    with pytest.raises(LaunchError, match=rf"^grouped_reduce \(epg_fake\): {re.escape(message)}.*\[args.grouped_reduce\]"):
        kern.launch(1, 256, **args)
    assert kern.raw.calls == []  # nothing reached the GPU


def test_launch_refuses_host_tensors_positions_and_foreign_structs():
    kern = _kernel("grouped_reduce")
    with pytest.raises(LaunchError, match="argument 'expert_out' must be a tensor on the GPU, got one on cpu"):
        kern.launch(1, 256, **_grouped_reduce_args())
    with pytest.raises(LaunchError, match="takes its arguments by name"):
        kern.launch(1, 256, torch.zeros(1))
    ep = _kernel("dispatch")
    with pytest.raises(LaunchError, match=r"takes one EpArgs .*got c_"):
        ep.launch(1, 256, ctypes.c_int64(0))
    with pytest.raises(LaunchError, match=r"takes one EpArgs .*got EpArgs and k"):
        ep.launch(1, 256, kernels.struct_type(ep.signature)(), k=3)
    assert kern.raw.calls == [] and ep.raw.calls == []
    args = kernels.struct_type(ep.signature)(k=8)
    assert ep.launch(2, 128, args) == 7 and ep.raw.calls[-1][2] == (args,)


def test_optional_pointer_passes_address_zero(monkeypatch):
    monkeypatch.setattr(kernels, "on_gpu", lambda t: True)
    kern = _kernel("dequantize_fp8")
    q, y = torch.zeros(8, dtype=torch.uint8), torch.zeros(8, dtype=torch.bfloat16)
    kern.launch(1, 64, q=q, scales=None, y=y, n_elems=8)
    assert kern.raw.calls[-1][2] == [q.data_ptr(), 0, y.data_ptr(), 8]


@pytest.mark.parametrize("old, new, needle, message", [
    ('args = "grouped_reduce"', 'args = "grouped_reduse"', 'args = "grouped_reduse"',
     "args 'grouped_reduse': no [args.grouped_reduse] table"),
    ('{ name = "hidden", type = "i64", doc = "elements per row (H)" },\n  { name = "apply_weights"',
     '{ name = "hidden", type = "i64", doc = "elements per row (H)", size = 4 },\n  { name = "apply_weights"',
     'size = 4', "unknown key 'size'"),
    ('{ name = "apply_weights", type = "i64"', '{ name = "apply_weights", type = "f64"', 'type = "f64"',
     "type 'f64' must be 'i64' or a pointer"),
    ('{ name = "apply_weights", type = "i64"', '{ name = "k", type = "i64"', 'name = "k", type = "i64", doc = "1: weight',
     "argument 'k': declared twice"),
    ('{ name = "apply_weights", type = "i64", doc = "1: weight each pair\'s row" }',
     '{ name = "apply_weights", type = "i64", doc = "1: weight each pair\'s row", optional = true }', "pair's row\", optional",
     "only a pointer argument may be optional"),
    ('{ name = "x", type = "addr"', '{ name = "x", type = "const char*"', "dispatch: this rank's token rows",
     "a struct's fields are 64 bits"),
    ('limits = { max_experts = 1024,', 'limits = { max_experts = 0,', 'limits = { max_experts = 0,',
     "limits.max_experts = 0: must be an integer >= 1"),
    ('{ name = "apply_weights", type = "i64"', '{ name = "apply weights", type = "i64"', '"apply weights"',
     "the name must be a C identifier"),
])
def test_bad_argument_declaration_is_located(spec_copy, old, new, needle, message):
    path = spec_copy / "kernels.toml"
    mutate(path, old, new)
    with pytest.raises(S.SpecError) as e:
        S.load(spec_copy)
    m = re.match(r"^(.+):(\d+): (.+)$", str(e.value))
    assert m and m.group(1).endswith("kernels.toml"), str(e.value)
    assert message in m.group(3), str(e.value)
    assert int(m.group(2)) == line_of(path, needle), str(e.value)


def test_bound_arguments_are_checked_once_and_the_rest_at_each_launch(monkeypatch):
    monkeypatch.setattr(kernels, "on_gpu", lambda t: True)
    kern = _kernel("grouped_reduce")
    args = _grouped_reduce_args()
    fixed = {n: args[n] for n in ("pair_pos", "recv_w", "total_recv", "k", "hidden")}
    bound = kern.bind(**fixed)
    rest = {n: v for n, v in args.items() if n not in fixed}
    assert bound.launch(4, 128, **rest) == 7
    order = [f.name for f in kern.signature.fields]
    assert kern.raw.calls[-1][2] == [args[n].data_ptr() if isinstance(args[n], torch.Tensor)
                                     else 0 if args[n] is None else args[n] for n in order]
    other = torch.zeros(4, dtype=torch.bfloat16)
    bound.launch(4, 128, **{**rest, "out": other})  # what changes per call goes in at each launch
    assert kern.raw.calls[-1][2][order.index("out")] == other.data_ptr()
    calls = len(kern.raw.calls)
    with pytest.raises(LaunchError, match="argument 'k' is bound already"):
        bound.launch(4, 128, **rest, k=8)
    with pytest.raises(LaunchError, match="argument 'out' is missing"):
        bound.launch(4, 128, **{n: v for n, v in rest.items() if n != "out"})
    with pytest.raises(LaunchError, match="argument 'k' must be an int, got float"):
        kern.bind(**{**fixed, "k": 8.0})
    with pytest.raises(LaunchError, match="argument 'strid' is not declared"):
        kern.bind(**fixed, strid=1)
    with pytest.raises(LaunchError, match="nothing to bind"):
        _kernel("dispatch").bind(k=1)
    assert len(kern.raw.calls) == calls  # no refused launch reached the GPU


def test_only_the_tail_family_carries_the_grouped_tail(every_variant):
    """dispatch_ll and dispatch_ll_tail render one template: the grouped layout's tail (its grid barrier and placing
    passes) is compiled into dispatch_ll_tail only, so the dispatch a graph runs carries no code it never executes."""
    _, variants = every_variant
    by_family = {}
    for v in variants:
        if v.family.name in ("dispatch_ll", "dispatch_ll_tail"):
            by_family.setdefault(v.family.name, []).append(v)
    assert set(by_family) == {"dispatch_ll", "dispatch_ll_tail"}
    assert sorted((v.target.name, v.name.split(".", 1)[1]) for v in by_family["dispatch_ll"]) == \
        sorted((v.target.name, v.name.split(".", 1)[1]) for v in by_family["dispatch_ll_tail"])
    for v in by_family["dispatch_ll"]:
        src = R.render(v)
        assert "epg_dispatch_grouped_tail" not in src and "epg_grid_sync" not in src, v.name
    for v in by_family["dispatch_ll_tail"]:
        assert "epg_dispatch_grouped_tail(a);" in R.render(v), v.name
