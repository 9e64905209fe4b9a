"""Compile every variant of the `all` profile for its target and verify its ISA (CPU, in CI).

Toolchains are required: a missing compiler fails these tests (CI installs clang 22; nvcc is on
the machine image) -- no target is skipped silently.
"""


import attrs
import pytest

from generator import build as B
from generator import render, toolchain
from generator.cli import main
from generator.model import Variant, enumerate_variants
from tests.support.scripts import load_script

param_lines = load_script("param_lines")  # what a kernel's SASS reads of the parameter bank


@pytest.fixture(scope="module")
def all_results(specs, cache_dir):
    return {r.variant.key: r for r in B.build(specs, specs.targets, "all", cache_dir=cache_dir)}


def test_every_variant_compiles_and_verifies(all_results, specs):
    variants, _ = enumerate_variants(specs, specs.targets, "all")
    assert set(all_results) == {v.key for v in variants}
    bad = {k: (r.status, r.message) for k, r in all_results.items() if not r.ok}
    assert not bad, bad
    for t in specs.targets:
        assert any(k.startswith(t + "/") for k in all_results), f"no variant for {t}"


@pytest.mark.parametrize("key,mnemonic", [
    ("gfx950/quantize_fp4.bf16.fp4_e2m1.fp4_blockwise", "v_cvt_scalef32_pk_fp4_f32"),
    ("gfx950/dequantize_fp4.bf16.fp4_e2m1.fp4_blockwise", "v_cvt_scalef32_pk_f32_fp4"),
    ("gfx1250/quantize_fp4.bf16.fp4_e2m1.fp4_blockwise", "v_cvt_scalef32_pk8_fp4_f32"),
    ("gfx942/quantize_fp8.bf16.fp8_e4m3fnuz.fp8_blockwise", "v_cvt_pk_fp8_f32"),
    ("sm_90/quantize_fp8.bf16.fp8_e4m3fn.fp8_direct_cast", "F2FP.SATFINITE.E4M3"),
    # the grouped layout's placement and reduce: 16-byte copies on the op's own buffers, every target
    ("sm_90/grouped_place.i32", "STG.E.128"), ("sm_90/grouped_reduce.bf16", "LDG.E.128"),
    ("gfx942/grouped_place.i32", "global_load_dwordx4"), ("gfx950/grouped_reduce.fp32", "global_store_dwordx4"),
    ("gfx1250/grouped_place.i32", "global_store_b128"), ("gfx1250/grouped_reduce.bf16", "global_load_b128"),
    # grouped_dequantize: the placement decodes each row with the target's own conversion instructions
    ("sm_90/grouped_place_fp8.bf16.fp8_e4m3fn.fp8_blockwise", "F2FP.F16.E4M3.UNPACK_B"),
    ("gfx942/grouped_place_fp8.bf16.fp8_e4m3fnuz.fp8_blockwise", "v_cvt_pk_f32_fp8"),
    ("gfx950/grouped_place_fp4.bf16.fp4_e2m1.fp4_blockwise", "v_cvt_scalef32_pk_f32_fp4"),
    ("gfx1250/grouped_place_fp4.fp32.fp4_e2m1.fp4_blockwise", "v_cvt_scale_pk8_f32_fp4"),
    # the gather combine (and its grouped staging): peer rows read in 16-byte vectors, ordered at system scope
    ("sm_90/combine_gather.bf16.intranode", "MEMBAR.SC.SYS"), ("gfx942/combine_gather.bf16.intranode", "flat_load_dwordx4"),
    ("gfx950/combine_gather.fp32.intranode", "buffer_inv sc0 sc1"),
    ("gfx1250/combine_gather.bf16.intranode", "global_inv scope:SCOPE_SYS"),
])
def test_spec_expectations_hold(all_results, key, mnemonic):
    """The spec-driven checks cover the instructions the issue names (the spec is the source)."""
    r = all_results[key]
    assert mnemonic in r.variant.expected_isa
    assert r.ok


def _disasm(r) -> str:
    tools = toolchain.find(r.variant.toolchain)
    return toolchain.run(toolchain.disassemble_command(r.variant.target, tools, r.artifact), tools).stdout


def _disasm_ops(r):
    return toolchain.opcodes(_disasm(r), r.variant.target.vendor)


#: the 64-byte lines of sm_90's parameter bank (c[0x0][0x200] on: the driver's descriptor line, then EpArgs from
#: 0x210) each EP kernel reads. Each line costs a constant-cache miss on the kernel's path at every launch; the field
#: order of specs/kernels.toml [args.ep] keeps these few (with the declared order before it: 9, 8, 9 and 8 for the
#: first four; the others read most of the struct and hold their counts so a new field does not spread them further).
#: combine_gather 6: its in-place staging reads each received row's source (off_recv_src, max_tokens), on a line no
#: other field of it shares in any order param_lines.py --suggest finds.
PARAM_LINES = {"combine_ll": 4, "dispatch_ll": 5, "dispatch_direct": 6, "combine_gather": 6,
               "dispatch_ll_tail": 8, "dispatch": 8, "combine_scatter": 7}


@pytest.mark.parametrize("family,most", sorted(PARAM_LINES.items()))
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_ep_kernels_read_few_parameter_lines(all_results, family, most, dtype):
    lines = param_lines.lines_read(param_lines.offsets(_disasm(all_results[f"sm_90/{family}.{dtype}.intranode"])))
    assert 0x200 // 64 in lines and len(lines) <= most, (
        f"{family} reads {len(lines)} lines ({', '.join(hex(line * 64) for line in sorted(lines))}), at most {most}: "
        "python scripts/param_lines.py --suggest says where the fields fit")


def test_low_latency_dispatch_moves_scale_bytes_only_with_a_scaled_payload(all_results):
    """dispatch_ll.j2 renders a float payload's low-latency dispatch with no scale words (S = 0, the plan gives such a
    payload none: tests/runtime/test_native_plan.py), so its message words have no byte loads or stores, while the
    pre-quantized fp8 payload's variant moves its scale bytes (the byte loops cost the one-token dispatch 0.9 us on
    an H200: docs/PERF.md). dispatch_ll_tail's grouped tail copies scale bytes of its own (grouped_tail.j2)."""
    def byte_ops(key):
        ops = _disasm_ops(all_results[key])
        return [op for op in ops if op.startswith(("LDG.E.U8", "STG.E.U8", "ST.E.U8", "LD.E.U8"))]

    assert not byte_ops("sm_90/dispatch_ll.bf16.intranode")
    assert byte_ops("sm_90/dispatch_ll.fp8_e4m3fn.intranode")


def _sass_functions(disassembly: str) -> dict[str, list[str]]:
    """Each function's opcodes in layout order (cuobjdump -sass: a "Function : NAME" header, then its instructions)."""
    out: dict[str, list[str]] = {}
    ops = None
    for line in disassembly.splitlines():
        if "Function :" in line:
            ops = out.setdefault(line.split("Function :", 1)[1].strip(), [])
            continue
        m = toolchain._SASS_LINE.search(line)
        if m and ops is not None:
            ops.append(m.group(1))
    return out


_MEMORY_OPS = ("LDG", "STG", "LD.", "ST.", "LDS", "STS", "ATOM", "RED", "LDSM", "CCTL")


def test_every_sm90_kernel_waits_for_the_kernel_before_it_before_any_memory_access(all_results):
    """specs/targets.toml's programmatic_launch on sm_90: the runtime launches every kernel with programmatic stream
    serialization, so a kernel may be launched while the one before it on the stream still writes what it reads.
    Every sm_90 kernel of the `all` profile must wait (griddepcontrol.wait: ACQBULK) before its first memory
    instruction, and none may let its successor launch early (griddepcontrol.launch_dependents: PREEXIT; measured
    slower, docs/PERF.md). A const __restrict__ input let nvcc hoist a read-only load above the wait (a wrong result
    on the GPU): generator/render.py renders such a target's const inputs without restrict."""
    checked = 0
    for key, r in sorted(all_results.items()):
        if not key.startswith("sm_90/"):
            continue
        assert r.variant.target.programmatic_launch
        functions = _sass_functions(_disasm(r))
        assert functions, key
        for name, ops in functions.items():
            assert "PREEXIT" not in ops, f"{key} {name}: launches its successor early"
            assert "ACQBULK" in ops, f"{key} {name}: no griddepcontrol.wait (epg_launch_begin)"
            before = [op for op in ops[:ops.index("ACQBULK")] if op.startswith(_MEMORY_OPS)]
            assert not before, f"{key} {name}: {before} before the wait for the kernel ahead of it"
        checked += 1
    assert checked > 30


@pytest.mark.parametrize("arch", ["gfx942", "gfx950", "gfx1250"])
def test_amd_kernels_have_no_programmatic_wait(specs, arch):
    """AMD targets declare no programmatic launch: their kernels run in stream order and render no wait."""
    assert not specs.targets[arch].programmatic_launch
    src = B.generated_root(specs) / arch / "dispatch_ll.bf16.intranode.hip"
    text = src.read_text()
    assert "epg_launch_begin();" in text and "griddepcontrol" not in text


def test_gfx1250_has_no_pair_form(all_results):
    ops = _disasm_ops(all_results["gfx1250/quantize_fp4.bf16.fp4_e2m1.fp4_blockwise"])
    assert toolchain.has_mnemonic(ops, "v_cvt_scalef32_pk8_fp4_f32")
    assert not toolchain.has_mnemonic(ops, "v_cvt_scalef32_pk_fp4_f32")


@pytest.mark.parametrize("key,scope,weaker", [
    ("gfx942/dispatch.bf16.intranode", "buffer_wbl2 sc0 sc1", "buffer_wbl2 sc1"),
    ("gfx950/combine_gather.bf16.intranode", "buffer_inv sc0 sc1", "buffer_inv sc1"),
    ("gfx1250/combine_scatter.bf16.intranode", "global_wb scope:SCOPE_SYS", "global_wb scope:SCOPE_DEV"),
])
def test_ep_kernels_order_at_system_scope(all_results, key, scope, weaker):
    """The EP kernels' write-backs and invalidations are system-scoped (the scope is an operand on AMD):
    expectations with operands match the instruction's operands, not just its mnemonic."""
    r = all_results[key]
    assert scope in r.variant.expected_isa and r.ok
    ops = _disasm_ops(r)
    assert toolchain.has_mnemonic(ops, scope)
    # a kernel holding only the weaker (device) scope would not pass
    weak_only = {op for op in ops if not op.startswith(scope)} | {weaker}
    assert not toolchain.has_mnemonic(weak_only, scope)


@pytest.mark.parametrize("key", ["sm_90/combine_scatter.bf16.fp8_e4m3fn.fp8_blockwise.intranode",
                                 "sm_90/combine_scatter.fp32.fp8_e4m3fn.fp8_blockwise.intranode"])
def test_scaled_decode_is_not_fused_into_the_sum(all_results, key):
    """An fp32-scaled wire element decodes as q * scale rounded on its own (epg_mul_rn), as the reference
    does, before the origin sums it: nvcc fuses a plain product into the following add (FFMA, one rounding),
    and then a row reached from 3 or more ranks can differ from the reference in its last bit (seen at 8
    ranks). Before epg_mul_rn this kernel held no FMUL at all."""
    assert toolchain.has_mnemonic(_disasm_ops(all_results[key]), "FMUL")


def test_operand_expectations_match_prefixes():
    ops = toolchain.opcodes("\tbuffer_wbl2 sc0 sc1                      // 000000001a2c: E0...\n"
                            "\ts_waitcnt vmcnt(0)\n\tglobal_inv scope:SCOPE_SYS\n", "amd")
    assert {"buffer_wbl2", "buffer_wbl2 sc0 sc1", "s_waitcnt vmcnt(0)", "global_inv scope:SCOPE_SYS"} <= ops
    assert toolchain.has_mnemonic(ops, "buffer_wbl2") and toolchain.has_mnemonic(ops, "buffer_wbl2 sc0")
    assert not toolchain.has_mnemonic(ops, "buffer_wbl2 sc1") and not toolchain.has_mnemonic(ops, "global_inv scope:SCOPE_DEV")


def test_verify_detects_missing_instruction(all_results):
    r = all_results["gfx950/quantize_fp8.bf16.fp8_e4m3fn.fp8_blockwise"]
    v = r.variant
    fake_target = attrs.evolve(v.target, isa=(("fp8_encode", ("v_cvt_scalef32_pk_fp4_f32",)),))
    ok, msg = B.verify(attrs.evolve(v, target=fake_target), toolchain.find(v.toolchain), r.artifact)
    assert not ok and "v_cvt_scalef32_pk_fp4_f32" in msg


def test_fp4_kernel_for_gfx942_does_not_compile(specs, tmp_path, cache_dir):
    """Forced past the rule, an FP4 kernel for gfx942 is a compile error, never silent zeros."""
    v = Variant(specs.families["quantize_fp4"], specs.dtypes["bf16"], specs.dtypes["fp4_e2m1"],
                specs.quants["fp4_blockwise"], specs.targets["gfx942"], None, specs.toolchains["amd"])
    src = tmp_path / v.file
    src.write_text(render.render(v))
    r = B.compile_variant(v, src, cache_dir, toolchain.find(v.toolchain))
    assert r.status == "failed" and "epg_fp4x8_encode" in r.message


def test_one_failure_does_not_hide_others(specs, tmp_path):
    out = tmp_path / "gen"
    B.write_target(specs, "gfx950", out)
    victim = out / "gfx950" / "quantize_fp8.bf16.fp8_e4m3fn.fp8_blockwise.hip"
    # break one source after rendering; build() re-renders, so compile directly from the tree
    victim.write_text(victim.read_text() + "\nthis is not C++;\n")
    variants, _ = enumerate_variants(specs, ["gfx950"], "all")
    tools = toolchain.find(variants[0].toolchain)
    results = [B.compile_variant(v, out / "gfx950" / v.file, tmp_path / "c", tools) for v in variants]
    failed = [r for r in results if not r.ok]
    assert [r.variant.file for r in failed] == [victim.name]
    assert "error" in failed[0].message
    assert sum(r.ok for r in results) == len(variants) - 1


def test_cache_hit_and_tamper(specs, tmp_path):
    first = B.build(specs, ["gfx950"], "all", only="dequantize_fp4.*", cache_dir=tmp_path)
    assert {r.status for r in first} == {"compiled"}
    second = B.build(specs, ["gfx950"], "all", only="dequantize_fp4.*", cache_dir=tmp_path)
    assert {r.status for r in second} == {"cached"} and all(r.ok for r in second)
    victim = second[0].artifact
    victim.write_bytes(victim.read_bytes()[:100])  # truncated entry
    third = B.build(specs, ["gfx950"], "all", only="dequantize_fp4.*", cache_dir=tmp_path)
    by_key = {r.variant.key: r.status for r in third}
    assert by_key[second[0].variant.key] == "compiled" and all(r.ok for r in third)


def test_missing_compiler_names_the_package(spec_copy, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "no-tools-here"))  # nvcc is a known name, found nowhere
    toolchain.find.cache_clear()
    try:
        rc = main(["--specs", str(spec_copy), "build", "--arch", "sm_90", "--profile", "all",
                   "--only", "quantize_fp8.bf16.*", "--cache-dir", str(tmp_path)])
    finally:
        toolchain.find.cache_clear()
    out = capsys.readouterr().out
    assert rc == 1
    assert "CUDA toolkit (nvcc)" in out and "NO TOOLCHAIN" in out


def test_cli_build_summary(specs, cache_dir, capsys):
    assert main(["build", "--arch", "gfx950", "--profile", "all", "--cache-dir", str(cache_dir)]) == 0
    n = len(enumerate_variants(specs, ["gfx950"], "all")[0])
    assert f"{n} ok, 0 failed" in capsys.readouterr().out


def test_cli_explain(capsys):
    assert main(["explain", "gfx942/quantize_fp4.bf16.fp4_e2m1.fp4_blockwise"]) == 1
    out = capsys.readouterr().out
    assert "fp4_conversion_target" in out and "gfx942 lacks the FP4 conversion intrinsics" in out
    assert main(["explain", "sm_90/quantize_fp4.bf16.fp4_e2m1.fp4_blockwise"]) == 0
    assert "epg_quantize_fp4__bf16__fp4_e2m1__fp4_blockwise" in capsys.readouterr().out
    assert main(["explain", "--family", "quantize_fp8", "--target", "gfx942", "--wire", "fp8_e4m3fn"]) == 1
    assert "fp8_native_ocp" in capsys.readouterr().out
