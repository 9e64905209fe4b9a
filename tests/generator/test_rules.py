"""Every rule rejects what it should; removing any rule makes its test fail."""

import attrs
import pytest

from generator.model import combination_facts, enumerate_variants, rejecting_rule

# rule name -> a combination it must reject (names of spec records)
CASES = {
    "fp4_conversion_target": dict(family="quantize_fp4", dtype="bf16", wire="fp4_e2m1", quant="fp4_blockwise", target="gfx942"),
    "fp8_native_ocp": dict(family="quantize_fp8", dtype="bf16", wire="fp8_e4m3fn", quant="fp8_direct_cast", target="gfx942"),
    "fp8_native_fnuz": dict(family="dequantize_fp8", dtype="fp32", wire="fp8_e4m3fnuz", quant="fp8_blockwise", target="sm_90"),
    "internode_quant_none": dict(dtype="bf16", wire="fp8_e4m3fn", quant="fp8_blockwise", topology="internode_v2"),
    "quant_fp8_wire": dict(family="dispatch", dtype="fp8_e4m3fn", wire="fp8_e4m3fn", quant="fp8_blockwise", target="sm_90"),
    "quant_fp4_wire": dict(family="combine_scatter", dtype="bf16", wire="fp8_e4m3fn", quant="fp4_blockwise", target="sm_90"),
    "wire_needs_quant": dict(family="dispatch", dtype="bf16", wire="fp8_e4m3fn", quant="none", target="gfx950"),
    "combine_dtype": dict(family=None, role="combine", dtype="fp8_e4m3fn", wire="fp8_e4m3fn", quant="none", topology="intranode"),
    "ll_verbatim": dict(family="dispatch_ll", dtype="bf16", wire="fp8_e4m3fn", quant="fp8_blockwise", target="sm_90",
                        topology="intranode"),
}
# combinations no rule may reject (guards against over-broad rules)
ADMITTED = [
    dict(family="quantize_fp4", dtype="bf16", wire="fp4_e2m1", quant="fp4_blockwise", target="gfx950"),
    dict(family="quantize_fp4", dtype="fp32", wire="fp4_e2m1", quant="fp4_blockwise", target="sm_90"),
    dict(family="quantize_fp8", dtype="bf16", wire="fp8_e4m3fnuz", quant="fp8_blockwise", target="gfx942"),
    dict(dtype="bf16", wire="bf16", quant="none", topology="internode_v2_ll"),
    # fp4 payload bytes move on gfx942 (no conversion); quantizing dispatch / compressed scatter elsewhere
    dict(family="dispatch", dtype="fp4_e2m1", wire="fp4_e2m1", quant="none", target="gfx942", topology="intranode"),
    dict(family="dispatch", dtype="bf16", wire="fp8_e4m3fnuz", quant="fp8_blockwise", target="gfx942", topology="intranode"),
    dict(family="combine_scatter", dtype="bf16", wire="fp4_e2m1", quant="fp4_blockwise", target="gfx1250", topology="intranode"),
    dict(family=None, role="combine", dtype="fp32", wire="fp32", quant="none", topology="intranode"),
    # the low-latency protocol moves any payload verbatim
    dict(family="dispatch_ll", dtype="fp8_e4m3fnuz", wire="fp8_e4m3fnuz", quant="none", target="gfx942", topology="intranode"),
    dict(family="dispatch_ll", dtype="fp4_e2m1", wire="fp4_e2m1", quant="none", target="gfx942", topology="intranode"),
    dict(family="combine_ll", dtype="bf16", wire="bf16", quant="none", target="sm_90", topology="intranode"),
]


def _facts(specs, case):
    case = dict(case)
    role = case.pop("role", None)
    pools = dict(family=specs.families, dtype=specs.dtypes, wire=specs.dtypes, quant=specs.quants,
                 target=specs.targets, topology=specs.topologies)
    facts = combination_facts(**{k: pools[k][v] for k, v in case.items() if v is not None})
    if role:
        facts["family.role"] = role
    return facts


def test_every_rule_has_a_case(specs):
    assert {r.name for r in specs.rules} == set(CASES)


@pytest.mark.parametrize("name", sorted(CASES))
def test_rule_rejects_and_is_needed(specs, name):
    facts = _facts(specs, CASES[name])
    rule = rejecting_rule(specs.rules, facts)
    assert rule is not None and rule.name == name
    assert rule.message  # what the user sees
    # without this rule, nothing else rejects the combination: the rule is what this test checks
    others = [r for r in specs.rules if r.name != name]
    assert rejecting_rule(others, facts) is None


@pytest.mark.parametrize("case", ADMITTED, ids=lambda c: "-".join(str(v) for v in c.values()))
def test_valid_combinations_admitted(specs, case):
    assert rejecting_rule(specs.rules, _facts(specs, case)) is None


def test_matrix_shape(specs):
    variants, rejected = enumerate_variants(specs, specs.targets, "all")
    keys = {v.key for v in variants}
    # gfx942: FP8 in FNUZ only, no FP4 conversion variant at all (fp4 payload bytes may still move)
    assert not any(v.target.name == "gfx942" and v.wire.kind == "fp4" and v.converts for v in variants)
    assert "gfx942/dispatch.fp4_e2m1.intranode" in keys
    assert not any(k.startswith("gfx942/") and "fp8_e4m3fn." in k for k in keys)
    assert "gfx942/quantize_fp8.bf16.fp8_e4m3fnuz.fp8_blockwise" in keys
    # FP4 on gfx950, gfx1250 and sm_90's software path
    for t in ("gfx950", "gfx1250", "sm_90"):
        assert f"{t}/quantize_fp4.bf16.fp4_e2m1.fp4_blockwise" in keys
        assert not any(k.startswith(f"{t}/") and "fnuz" in k for k in keys)
    assert {r.rule.name for r in rejected} >= {"fp4_conversion_target", "fp8_native_ocp", "fp8_native_fnuz"}
    # derived names are unique and symbols are C identifiers
    assert len({v.key for v in variants}) == len(variants)
    assert all(v.symbol.isidentifier() for v in variants)


def test_profiles_filter(specs):
    default, _ = enumerate_variants(specs, ["gfx950"], "default")
    everything, _ = enumerate_variants(specs, ["gfx950"], "all")
    assert default and set(map(str, default)) < set(map(str, everything))
    assert all(v.dtype.name == "bf16" for v in default)
    only, _ = enumerate_variants(specs, ["gfx950"], "all", only="quantize_fp4.*")
    assert {v.family.name for v in only} == {"quantize_fp4"}


def test_variant_is_frozen_and_derives_everything(specs):
    v = enumerate_variants(specs, ["gfx1250"], "all", only="quantize_fp4.bf16.*")[0][0]
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        v.dtype = specs.dtypes["fp32"]
    assert v.key == "gfx1250/quantize_fp4.bf16.fp4_e2m1.fp4_blockwise"
    assert v.file == "quantize_fp4.bf16.fp4_e2m1.fp4_blockwise.hip"
    assert v.symbol == "epg_quantize_fp4__bf16__fp4_e2m1__fp4_blockwise"
    assert v.expected_isa == ("v_cvt_scalef32_pk8_fp4_f32",)
    assert v.forbidden_isa == ("v_cvt_scalef32_pk_fp4_f32",)
