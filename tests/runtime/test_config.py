"""EpDispatchCombineConfig: every validation error and its message, backend precedence, derived values."""

from __future__ import annotations

import re

import attrs
import pytest
import torch

from generator import specs as gspecs
from runtime import ConfigError, EpDispatchCombineConfig, EpgenError
from runtime import config as rconfig

BASE = dict(rank=0, world_size=2, hidden_dim=64, max_num_inp_token_per_rank=16, num_experts_per_rank=4,
            num_experts_per_token=2)

FIELD_ORDER = ("rank", "world_size", "hidden_dim", "max_num_inp_token_per_rank", "num_experts_per_rank",
               "num_experts_per_token", "data_type", "dispatch_data_type", "combine_data_type", "scale_dim",
               "scale_type_size", "combine_mode", "quant_type", "dispatch_quant_type", "enable_std_moe", "max_total_recv_tokens",
               "gpu_per_node", "internode_kernel", "internode_auto_ll_max_tokens", "intranode_protocol", "kernel_backend",
               "timeout_s", "expert_capacity", "strict_capacity", "launch_blocks", "launch_threads", "launch_rows",
               "enable_grouped_layout", "expert_alignment", "grouped_capacity", "grouped_dequantize", "max_inflight",
               # the seed library's fields (runtime/aliases.py)
               "dispatch_block_num", "combine_block_num", "warp_num_per_block", "combine_warp_num_per_block",
               "schedule", "num_qp_per_pe", "dispatch_rdma_block_num", "combine_rdma_block_num",
               "max_token_type_size")


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    monkeypatch.delenv(rconfig.BACKEND_ENV, raising=False)


def make(**kw) -> EpDispatchCombineConfig:
    return EpDispatchCombineConfig(**{**BASE, **kw})


def rejects(pattern: str | None, **kw) -> ConfigError:
    with pytest.raises(ConfigError, match=pattern) as err:
        make(**kw)
    return err.value


def rule(name: str):
    return next(r for r in gspecs.load().rules if r.name == name)


# --- shape of the class ----------------------------------------------------------------------
def test_fields_in_order_with_defaults():
    assert rconfig.FIELDS == FIELD_ORDER
    c = make()
    assert (c.data_type, c.dispatch_data_type, c.combine_data_type) == (torch.bfloat16, None, None)
    assert (c.scale_dim, c.scale_type_size, c.combine_mode, c.quant_type) == (0, 0, None, "none")
    assert c.dispatch_quant_type == "none" and c.resolved_combine_mode == "gather"
    assert (c.enable_std_moe, c.max_total_recv_tokens, c.gpu_per_node) == (False, 0, 0)
    assert (c.internode_kernel, c.internode_auto_ll_max_tokens, c.kernel_backend) == ("auto", 512, None)
    assert c.timeout_s == 30.0
    assert (c.expert_capacity, c.strict_capacity, c.resolved_expert_capacity) == (0, False, 32)
    assert (c.enable_grouped_layout, c.grouped_dequantize) == (False, False)


def test_frozen_kw_only_hashable():
    c = make()
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        c.rank = 1
    with pytest.raises(TypeError):
        EpDispatchCombineConfig(0, 2, 64, 16, 4, 2)
    assert c == make() and hash(c) == hash(make()) and c.key == make().key
    assert c != make(rank=1) and c.key != make(rank=1).key
    assert {c.key: 1}[make().key] == 1


def test_error_classes():
    err = rejects("rank", rank=5)
    assert isinstance(err, ValueError) and isinstance(err, EpgenError)


def test_derived_values():
    c = make(world_size=4, rank=3, num_experts_per_rank=8)
    assert c.num_experts == 32
    assert c.max_recv_tokens == 4 * 16
    assert make(max_total_recv_tokens=20).max_recv_tokens == 20
    assert c.resolved_gpu_per_node == 4 and not c.is_internode
    assert c.topology_names == ("intranode",)
    assert make(world_size=1).max_recv_tokens == 16


def test_torch_dtype_names_from_specs():
    specs = gspecs.load()
    assert rconfig.torch_dtype_name("bf16") == specs.dtypes["bf16"].torch == "bfloat16"
    assert rconfig.torch_dtype("fp32") is torch.float32
    assert rconfig.spec_dtype(torch.bfloat16).name == "bf16"
    assert rconfig.spec_dtype(torch.float16) is None
    assert rconfig.built_torch_dtypes() == (torch.bfloat16, torch.float32)


# --- types and ranges ------------------------------------------------------------------------
INT_FIELDS = ("rank", "world_size", "hidden_dim", "max_num_inp_token_per_rank", "num_experts_per_rank",
              "num_experts_per_token", "scale_dim", "scale_type_size", "max_total_recv_tokens", "gpu_per_node",
              "internode_auto_ll_max_tokens", "expert_capacity")


@pytest.mark.parametrize("field", INT_FIELDS)
@pytest.mark.parametrize("value", ["1", 1.0, True])
def test_int_fields_must_be_int(field, value):
    rejects(f"^{field}={re.escape(repr(value))}: must be an int$", **{field: value})


@pytest.mark.parametrize("field", ["world_size", "hidden_dim", "max_num_inp_token_per_rank", "num_experts_per_rank",
                                   "num_experts_per_token", "internode_auto_ll_max_tokens"])
@pytest.mark.parametrize("value", [0, -3])
def test_positive_fields(field, value):
    kw = {field: value}
    if field == "world_size":
        kw["rank"] = 0
    rejects(f"^{field}={value}: must be positive$", **kw)


@pytest.mark.parametrize("field", ["scale_dim", "scale_type_size", "max_total_recv_tokens", "gpu_per_node",
                                   "expert_capacity"])
def test_non_negative_fields(field):
    rejects(f"^{field}=-1: must be >= 0$", **{field: -1})


@pytest.mark.parametrize("kw,what", [
    (dict(world_size=64, rank=0, max_num_inp_token_per_rank=2 ** 20), "max_total_recv_tokens (resolved) x world_size"),
    (dict(world_size=2, max_num_inp_token_per_rank=2 ** 30, max_total_recv_tokens=2), "max_num_inp_token_per_rank x world_size"),
    (dict(world_size=2, max_num_inp_token_per_rank=2 ** 26, num_experts_per_token=32, num_experts_per_rank=16),
     "max_total_recv_tokens (resolved) x num_experts_per_token"),
    (dict(world_size=2, max_num_inp_token_per_rank=2 ** 24, num_experts_per_rank=2 ** 10),
     "num_experts_per_rank x expert capacity"),
])
def test_row_numbers_fit_int32(kw, what):
    """Routing handles number rows in int32: configs whose row numbers would wrap are rejected."""
    rejects(rf"^max_num_inp_token_per_rank=\d+: {re.escape(what)}", **kw)


@pytest.mark.parametrize("world,epr", [(1, 3), (2, 4), (8, 1), (4, 16)])
def test_top_k_at_most_num_experts(world, epr):
    """A token's top-k picks k of the num_experts = world_size x num_experts_per_rank experts: k = num_experts
    is accepted, k = num_experts + 1 refused naming the field and the number of experts (whatever the rank).
    Ids repeated within a token's row stay legal: they are data, checked by no config."""
    n = world * epr
    assert make(world_size=world, num_experts_per_rank=epr, num_experts_per_token=n).num_experts == n
    for rank in {0, world - 1}:
        err = rejects(rf"^num_experts_per_token={n + 1}: must be <= num_experts = world_size x num_experts_per_rank "
                      rf"= {n} \(a token's top-k picks k of the experts\)$",
                      rank=rank, world_size=world, num_experts_per_rank=epr, num_experts_per_token=n + 1)
        assert err.__cause__ is None and err.__context__ is None
    # far above (the 100 of 8 and 1000 of 8), and the per-field checks still come first
    for k in (100, 1000):
        rejects(rf"^num_experts_per_token={k}: must be <= num_experts = world_size x num_experts_per_rank = 8 ",
                num_experts_per_rank=4, num_experts_per_token=k)
    rejects(r"^num_experts_per_token=0: must be positive$", num_experts_per_token=0)
    rejects(r"^num_experts_per_rank=0: must be positive$", num_experts_per_rank=0, num_experts_per_token=100)


def test_seed_config_top_k_at_most_num_experts():
    """The seed API (runtime.seed_compat): its config keeps the seed's own checks and may be edited after
    construction; the op reads it when constructed and refuses k > num_experts with the core's one ConfigError,
    before anything is built (no process group needed)."""
    from runtime.seed_compat import EpDispatchCombineConfig as SeedConfig, EpDispatchCombineOp as SeedOp

    msg = (r"^num_experts_per_token=9: must be <= num_experts = world_size x num_experts_per_rank = 8 "
           r"\(a token's top-k picks k of the experts\)$")
    seed = dict(rank=0, world_size=2, hidden_dim=64, max_num_inp_token_per_rank=8, num_experts_per_rank=4,
                kernel_backend="torch")
    for backend in ("torch", "flydsl", "hip"):
        cfg = SeedConfig(**{**seed, "kernel_backend": backend}, num_experts_per_token=9)
        with pytest.raises(ConfigError, match=msg) as err:
            SeedOp(cfg, None)
        assert err.value.__context__ is None
    edited = SeedConfig(**seed, num_experts_per_token=8)  # valid when built, then edited (the seed's class is mutable)
    edited.num_experts_per_token = 9
    with pytest.raises(ConfigError, match=msg):
        SeedOp(edited, None)
    one = SeedConfig(**{**seed, "world_size": 1}, num_experts_per_token=4)
    with SeedOp(one, None) as op:  # k = num_experts on one rank: built
        assert op.cfg.num_experts_per_token == 4


@pytest.mark.parametrize("rank", [-1, 2, 7])
def test_rank_range(rank):
    rejects(rf"^rank={rank}: must be in \[0, world_size=2\)$", rank=rank)


@pytest.mark.parametrize("field,value,msg", [
    ("combine_mode", 1, "must be a str or None"),
    ("quant_type", None, "must be a str"),
    ("dispatch_quant_type", None, "must be a str"),
    ("internode_kernel", b"v2", "must be a str"),
    ("enable_std_moe", 1, "must be a bool"),
    ("strict_capacity", None, "must be a bool"),
    ("kernel_backend", 3, "must be a str or None"),
    ("data_type", "bfloat16", "must be a torch.dtype"),
    ("dispatch_data_type", "bf16", "must be a torch.dtype or None"),
    ("combine_data_type", 16, "must be a torch.dtype or None"),
])
def test_other_types(field, value, msg):
    rejects(f"^{field}={re.escape(repr(value))}: {msg}$", **{field: value})


@pytest.mark.parametrize("value", ["30", None, True, b"1", 1j])
def test_timeout_type(value):
    rejects(f"^timeout_s={re.escape(repr(value))}: must be a number of seconds \\(int or float\\)$", timeout_s=value)


@pytest.mark.parametrize("value", [0, 0.0, -1, -0.5, float("nan"), float("inf"), float("-inf"), 10 ** 400])
def test_timeout_positive_finite(value):
    err = rejects(r": must be > 0 and finite \(seconds a device-side wait may last\)$", timeout_s=value)
    assert str(err).startswith("timeout_s=")


@pytest.mark.parametrize("value,stored", [(30, 30.0), (0.001, 0.001), (1e9, 1e9)])
def test_timeout_accepted_as_float(value, stored):
    c = make(timeout_s=value)
    assert c.timeout_s == stored and type(c.timeout_s) is float
    assert c == make(timeout_s=stored) and c.key == make(timeout_s=stored).key
    assert c.key != make(timeout_s=stored * 2).key


def test_world_size_multiple_of_gpu_per_node():
    rejects(r"^gpu_per_node=4: world_size=6 must be a multiple of gpu_per_node$", world_size=6, gpu_per_node=4)


def test_max_total_recv_tokens_at_most_worst_case():
    make(max_total_recv_tokens=32)
    rejects(r"^max_total_recv_tokens=33: must be <= the worst case world_size \* max_num_inp_token_per_rank = 32",
            max_total_recv_tokens=33)


# --- names ------------------------------------------------------------------------------------
def test_combine_mode_names():
    rejects(r"^combine_mode='sum': must be one of 'gather', 'scatter' or None$", combine_mode="sum")
    assert make(combine_mode="scatter").resolved_combine_mode == "scatter"
    assert make(combine_mode="gather").resolved_combine_mode == "gather"


def test_quant_type_names_from_specs():
    names = ", ".join(repr(q) for q in gspecs.load().quants)
    rejects(f"^quant_type='int4': must be one of {re.escape(names)} \\(specs/quant.toml\\)$", quant_type="int4")


def test_dispatch_quant_type_names():
    rejects(r"^dispatch_quant_type='fp8_direct_cast': must be one of 'none', 'fp8_blockwise', 'fp4_blockwise'$",
            dispatch_quant_type="fp8_direct_cast")


def test_internode_kernel_names():
    rejects(r"^internode_kernel='v3': must be one of 'v2', 'v2_ll', 'auto'$", internode_kernel="v3")


def test_kernel_backend_names():
    rejects(r"^kernel_backend='cuda': must be one of 'native', 'torch' or None$", kernel_backend="cuda")


# --- dtypes -----------------------------------------------------------------------------------
def test_unknown_dtype():
    rejects(r"^data_type=torch.float16: unknown dtype; supported in this release: torch.bfloat16, torch.float32$",
            data_type=torch.float16)
    rejects(r"^dispatch_data_type=torch.int8: unknown dtype; supported in this release: torch.bfloat16, "
            r"torch.float32, torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float4_e2m1fn_x2$",
            dispatch_data_type=torch.int8, combine_data_type=torch.bfloat16)
    rejects(r"^combine_data_type=torch.float16: unknown dtype; supported in this release: torch.bfloat16, "
            r"torch.float32$", dispatch_data_type=torch.float8_e4m3fn, combine_data_type=torch.float16)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float4_e2m1fn_x2])
def test_data_type_is_the_model_dtype(dtype):
    rejects(rf"^data_type={re.escape(str(dtype))}: must be the model dtype, torch.bfloat16, torch.float32 \(an "
            r"fp8/fp4 payload is dispatch_data_type, with combine_data_type torch.bfloat16, torch.float32\)$",
            data_type=dtype)


def test_float32_payload():
    assert make(data_type=torch.float32).combine_dtype is torch.float32


def test_dispatch_and_combine_dtypes_both_or_neither():
    rejects(r"^dispatch_data_type=torch.bfloat16, combine_data_type=None: set both or neither$",
            dispatch_data_type=torch.bfloat16)
    rejects(r"^dispatch_data_type=None, combine_data_type=torch.float32: set both or neither$",
            combine_data_type=torch.float32)
    c = make(dispatch_data_type=torch.bfloat16, combine_data_type=torch.bfloat16)
    assert c.dispatch_dtype is c.combine_dtype is torch.bfloat16


def test_float_wire_dtype_conversion_not_built_yet():
    rejects(r"^dispatch_data_type=torch.float32: must equal data_type=torch.bfloat16 for a bf16/fp32 payload "
            r"\(dtype conversion on the wire is not built yet\)$",
            dispatch_data_type=torch.float32, combine_data_type=torch.bfloat16)
    rejects(r"^combine_data_type=torch.float32: must equal data_type",
            dispatch_data_type=torch.bfloat16, combine_data_type=torch.float32)


@pytest.mark.parametrize("field", ["scale_dim", "scale_type_size"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_scales_zero_for_float_payloads(field, dtype):
    rejects(rf"^{field}=4: must be 0 for a {re.escape(str(dtype))} payload \(scales are for fp8/fp4 payloads\)$",
            data_type=dtype, **{field: 4})


def test_max_total_recv_tokens_at_least_one_token_per_rank():
    make(max_total_recv_tokens=2)  # world_size=2
    make(world_size=1, max_total_recv_tokens=1)
    for bad in (1,):
        rejects(r"^max_total_recv_tokens=1: capacity smaller than one token per rank: must be >= world_size=2",
                max_total_recv_tokens=bad)
    rejects(r"^max_total_recv_tokens=3: capacity smaller than one token per rank: must be >= world_size=4",
            world_size=4, max_total_recv_tokens=3)


def test_expert_capacity():
    assert make(expert_capacity=5).resolved_expert_capacity == 5
    assert make(max_total_recv_tokens=8).resolved_expert_capacity == 8
    assert make(max_total_recv_tokens=8, expert_capacity=8).resolved_expert_capacity == 8
    rejects(r"^expert_capacity=9: must be <= max_recv_tokens=8 ", max_total_recv_tokens=8, expert_capacity=9)
    rejects(r"^expert_capacity=33: must be <= max_recv_tokens=32 ", expert_capacity=33)
    rejects(r"^expert_capacity=-1: must be >= 0$", expert_capacity=-1)
    rejects(r"^expert_capacity=1.0: must be an int$", expert_capacity=1.0)
    rejects(r"^expert_capacity=True: must be an int$", expert_capacity=True)
    rejects(r"^strict_capacity=1: must be a bool$", strict_capacity=1)
    assert make(strict_capacity=True).key != make().key


# --- standard MoE, and what is not built yet -----------------------------------------------------
def test_std_moe_accepted_intranode():
    c = make(enable_std_moe=True, expert_capacity=4)
    assert c.enable_std_moe and c.resolved_expert_capacity == 4
    make(enable_std_moe=True, data_type=torch.float32)


def test_std_moe_internode_rejected():
    rejects(r"^enable_std_moe=True: the standard-MoE layout conversion is intranode only; world_size=16 > "
            r"gpu_per_node=8 is internode$", world_size=16, gpu_per_node=8, enable_std_moe=True)


@pytest.mark.parametrize("kernel", ["v2", "v2_ll", "auto"])
def test_internode_accepted(kernel):
    c = make(world_size=16, gpu_per_node=8, internode_kernel=kernel)
    assert c.is_internode and c.resolved_gpu_per_node == 8
    assert c.topology_names == {"v2": ("internode_v2",), "v2_ll": ("internode_v2_ll",)}.get(
        kernel, ("internode_v2", "internode_v2_ll"))
    assert make(world_size=16, gpu_per_node=8, kernel_backend="native").is_internode  # the op rejects native


def test_internode_scatter_rejected():
    rejects(r"^combine_mode='scatter': internode \(world_size=16 > gpu_per_node=8\) combines with "
            r"combine_mode='gather' only \(the scatter combine is intranode only\)$",
            world_size=16, gpu_per_node=8, combine_mode="scatter")


# --- spec rules (the generator's rule engine, the spec's own words) -----------------------------
@pytest.mark.parametrize("kernel", ["v2", "v2_ll", "auto"])
@pytest.mark.parametrize("quant", [q for q in gspecs.load().quants if q != "none"])
def test_internode_quant_rule(kernel, quant):
    r = rule("internode_quant_none")
    err = rejects(None, world_size=16, gpu_per_node=8, internode_kernel=kernel, quant_type=quant, hidden_dim=128)
    assert str(err) == f"{r.name}: {r.message}"


@pytest.mark.parametrize("quant", ["fp8_blockwise", "fp4_blockwise"])
def test_internode_dispatch_quant_rule(quant):
    r = rule("internode_quant_none")
    err = rejects(None, world_size=16, gpu_per_node=8, dispatch_quant_type=quant, hidden_dim=128)
    assert str(err) == f"{r.name}: {r.message}"


def test_rule_facts_describe_the_config():
    all_facts = make().rule_facts()
    assert all_facts and all(f["dtype"] == "bf16" and f["quant"] == "none" and f["topology"] == "intranode"
                             and f["topology.kind"] == "intranode" and f["wire"] == "bf16" for f in all_facts)


def test_config_uses_the_spec_rule_engine(monkeypatch):
    specs = gspecs.load()
    extra = gspecs.Rule(name="test_only_rule", message="rejected by a rule the test added",
                        when=(("dtype", ("fp32",)), ("topology.kind", ("intranode",))))
    monkeypatch.setattr(rconfig, "load_specs", lambda: attrs.evolve(specs, rules=specs.rules + (extra,)))
    make(data_type=torch.bfloat16)
    rejects(r"^test_only_rule: rejected by a rule the test added$", data_type=torch.float32)


def _role_facts(c, role):
    return [f for f in c.rule_facts() if f["family.role"] == role]


def test_rule_facts_of_low_precision_modes():
    # combine wire compression: combine_scatter, fp8 wire either format (the target decides)
    c = make(quant_type="fp8_blockwise", hidden_dim=128)
    comb = _role_facts(c, "combine")
    assert [(f["family"], f["dtype"], f["wire"], f["quant"], f["convert"]) for f in comb] == [
        ("combine_scatter", "bf16", "fp8_e4m3fn", "fp8_blockwise", "float_to_fp8"),
        ("combine_scatter", "bf16", "fp8_e4m3fnuz", "fp8_blockwise", "float_to_fp8")]
    assert [len(g) for g in c.rule_fact_groups()] == [1, 2]
    fp4 = _role_facts(make(quant_type="fp4_blockwise", data_type=torch.float32), "combine")
    assert [(f["dtype"], f["wire"], f["convert"]) for f in fp4] == [("fp32", "fp4_e2m1", "float_to_fp4")]
    # in-kernel dispatch quantization
    d = _role_facts(make(dispatch_quant_type="fp4_blockwise"), "dispatch")
    assert [(f["family"], f["dtype"], f["wire"], f["quant"], f["convert"]) for f in d] == [
        ("dispatch", "bf16", "fp4_e2m1", "fp4_blockwise", "float_to_fp4")]
    # a pre-quantized payload is the dispatch family's dtype itself, moved unchanged
    p = make(dispatch_data_type=torch.float8_e4m3fnuz, combine_data_type=torch.float32, scale_dim=2,
             scale_type_size=4)
    assert [(f["dtype"], f["wire"], f["quant"], f["convert"]) for f in _role_facts(p, "dispatch")] == [
        ("fp8_e4m3fnuz", "fp8_e4m3fnuz", "none", "same")]
    assert [(f["family"], f["dtype"], f["wire"]) for f in _role_facts(p, "combine")] == [
        ("combine_gather", "fp32", "fp32")]


def _with_rule(monkeypatch, **when):
    specs = gspecs.load()
    extra = gspecs.Rule(name="test_only_rule", message="rejected by a rule the test added",
                        when=tuple((k, (v,)) for k, v in when.items()))
    monkeypatch.setattr(rconfig, "load_specs", lambda: attrs.evolve(specs, rules=specs.rules + (extra,)))


def test_target_dependent_wire_passes_if_any_format_passes(monkeypatch):
    _with_rule(monkeypatch, wire="fp8_e4m3fnuz", **{"family.role": "combine"})
    make(quant_type="fp8_direct_cast")  # the ocp alternative passes
    _with_rule(monkeypatch, **{"wire.kind": "fp8", "family.role": "combine"})
    rejects(r"^test_only_rule: rejected by a rule the test added$", quant_type="fp8_direct_cast")


def test_dispatch_facts_reach_the_rule_engine(monkeypatch):
    _with_rule(monkeypatch, dtype="fp4_e2m1", family="dispatch")
    make(dispatch_quant_type="fp4_blockwise")
    rejects(r"^test_only_rule: ", dispatch_data_type=torch.float4_e2m1fn_x2, combine_data_type=torch.bfloat16,
            scale_dim=2, scale_type_size=1)


# --- pre-quantized payloads (dispatch_data_type fp8/fp4) ----------------------------------------
PAYLOADS = [torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float4_e2m1fn_x2]


def payload(dtype=torch.float8_e4m3fn, **kw):
    return make(**{**dict(dispatch_data_type=dtype, combine_data_type=torch.bfloat16, scale_dim=2,
                          scale_type_size=4), **kw})


@pytest.mark.parametrize("dtype", PAYLOADS)
@pytest.mark.parametrize("combine", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("data_type", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("size", [1, 4])
def test_prequantized_payloads(dtype, combine, data_type, size):
    c = payload(dtype, combine_data_type=combine, data_type=data_type, scale_type_size=size)
    assert c.prequantized and c.dispatch_dtype is dtype and c.combine_dtype is combine
    assert c.dispatch_payload_cols == (32 if dtype == torch.float4_e2m1fn_x2 else 64)
    assert c.dispatch_scales_dtype is (torch.float32 if size == 4 else torch.uint8)
    assert c.resolved_combine_mode == "gather" and c.dispatch_quant_block == 0


def test_prequantized_both_or_neither():
    rejects(r"^dispatch_data_type=torch.float8_e4m3fn, combine_data_type=None: set both or neither$",
            dispatch_data_type=torch.float8_e4m3fn, scale_dim=2, scale_type_size=4)
    rejects(r"^dispatch_data_type=None, combine_data_type=torch.bfloat16: set both or neither$",
            combine_data_type=torch.bfloat16, scale_dim=2, scale_type_size=4)


@pytest.mark.parametrize("dtype", PAYLOADS)
def test_prequantized_combine_dtype(dtype):
    payload_rejects(rf"^combine_data_type={re.escape(str(dtype))}: with a {re.escape(str(dtype))} payload, "
                    r"combine_data_type must be torch.bfloat16, torch.float32$", dtype, combine_data_type=dtype)


def payload_rejects(pattern, dtype=torch.float8_e4m3fn, **kw):
    with pytest.raises(ConfigError, match=pattern):
        payload(dtype, **kw)


@pytest.mark.parametrize("dtype", PAYLOADS)
def test_prequantized_gather_only(dtype):
    d = re.escape(str(dtype))
    payload_rejects(rf"^combine_mode='scatter': a pre-quantized {d} payload \(dispatch_data_type\) combines with "
                    r"combine_mode='gather' only$", dtype, combine_mode="scatter")
    payload_rejects(r"^combine_mode=None \(resolved to 'scatter' for quant_type='fp8_direct_cast'\): a "
                    rf"pre-quantized {d} payload", dtype, quant_type="fp8_direct_cast")
    payload_rejects(r"^combine_mode='gather': quant_type='fp8_direct_cast' forces combine_mode='scatter'", dtype,
                    combine_mode="gather", quant_type="fp8_direct_cast")


@pytest.mark.parametrize("dtype", PAYLOADS)
def test_prequantized_needs_scales(dtype):
    payload_rejects(rf"^scale_dim=0: a {re.escape(str(dtype))} payload needs scales: scale_dim must be > 0 "
                    r"\(scale columns per token\)$", dtype, scale_dim=0)


@pytest.mark.parametrize("size", [0, 2, 8])
def test_prequantized_scale_type_size(size):
    payload_rejects(rf"^scale_type_size={size}: must be 1 \(e8m0 bytes, torch.uint8\) or 4 \(torch.float32\) "
                    r"for a torch.float8_e4m3fn payload$", scale_type_size=size)


def test_fp4_payload_needs_even_hidden():
    payload_rejects(r"^hidden_dim=63: a torch.float4_e2m1fn_x2 payload packs two values per byte: hidden_dim "
                    r"must be even$", torch.float4_e2m1fn_x2, hidden_dim=63)
    assert payload(torch.float4_e2m1fn_x2, hidden_dim=62).dispatch_payload_cols == 31
    assert payload(torch.float8_e4m3fn, hidden_dim=63).dispatch_payload_cols == 63


# --- in-kernel dispatch quantization (dispatch_quant_type) --------------------------------------
@pytest.mark.parametrize("quant,block", [("fp8_blockwise", 128), ("fp4_blockwise", 32)])
@pytest.mark.parametrize("data_type", [torch.bfloat16, torch.float32])
def test_dispatch_quant(quant, block, data_type):
    c = make(dispatch_quant_type=quant, hidden_dim=2 * block, data_type=data_type)
    assert c.dispatch_quant_block == block and c.dispatch_dtype is c.combine_dtype is data_type
    assert not c.prequantized and c.dispatch_scales_dtype is None and c.resolved_combine_mode == "gather"
    assert make(dispatch_quant_type=quant, hidden_dim=block, quant_type=quant).resolved_combine_mode == "scatter"


@pytest.mark.parametrize("quant,block,hidden", [("fp8_blockwise", 128, 64), ("fp8_blockwise", 128, 192),
                                                ("fp4_blockwise", 32, 48), ("fp4_blockwise", 32, 16)])
def test_dispatch_quant_hidden_block(quant, block, hidden):
    rejects(rf"^hidden_dim={hidden}: dispatch_quant_type='{quant}' scales blocks of {block} elements: hidden_dim "
            rf"must be a multiple of {block}$", dispatch_quant_type=quant, hidden_dim=hidden)


@pytest.mark.parametrize("quant", ["fp8_blockwise", "fp4_blockwise"])
@pytest.mark.parametrize("dtype", PAYLOADS + [torch.bfloat16])
def test_dispatch_quant_needs_data_type_payload(quant, dtype):
    rejects(rf"^dispatch_quant_type='{quant}': in-kernel quantization takes a data_type payload: "
            rf"dispatch_data_type must be None, got {re.escape(str(dtype))}$",
            dispatch_quant_type=quant, hidden_dim=128, dispatch_data_type=dtype, combine_data_type=torch.bfloat16,
            scale_dim=2, scale_type_size=4)


@pytest.mark.parametrize("field", ["scale_dim", "scale_type_size"])
def test_dispatch_quant_makes_its_own_scales(field):
    rejects(rf"^{field}=4: must be 0 for a torch.bfloat16 payload", dispatch_quant_type="fp8_blockwise",
            hidden_dim=128, **{field: 4})


# --- combine wire compression (quant_type) ------------------------------------------------------
@pytest.mark.parametrize("quant", ["fp8_direct_cast", "fp8_blockwise", "fp4_blockwise"])
def test_quant_type_resolves_scatter(quant):
    c = make(quant_type=quant, hidden_dim=128)
    assert c.combine_mode is None and c.resolved_combine_mode == "scatter"
    assert make(quant_type=quant, hidden_dim=128, combine_mode="scatter").resolved_combine_mode == "scatter"
    rejects(rf"^combine_mode='gather': quant_type='{quant}' forces combine_mode='scatter' \(combine wire "
            r"compression runs in the scatter combine; None resolves it\)$",
            quant_type=quant, hidden_dim=128, combine_mode="gather")


@pytest.mark.parametrize("quant,block,hidden", [("fp8_blockwise", 128, 64), ("fp4_blockwise", 32, 48)])
def test_quant_type_hidden_block(quant, block, hidden):
    rejects(rf"^hidden_dim={hidden}: quant_type='{quant}' scales blocks of {block} elements: hidden_dim must be a "
            rf"multiple of {block}$", quant_type=quant, hidden_dim=hidden)


def test_fp8_direct_cast_any_hidden():
    assert make(quant_type="fp8_direct_cast", hidden_dim=40).combine_quant_block == 0


def test_key_covers_new_fields():
    assert make().key != make(dispatch_quant_type="fp4_blockwise").key
    assert make().key != make(combine_mode="gather").key  # None and an explicit "gather" are distinct fields


# --- kernel backend precedence ----------------------------------------------------------------
def test_backend_default_follows_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert make().resolved_backend == "torch"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert make().resolved_backend == "native"


def test_backend_field_used_without_env():
    assert make(kernel_backend="native").resolved_backend == "native"
    assert make(kernel_backend="torch").resolved_backend == "torch"


def test_env_overrides_field(monkeypatch):
    monkeypatch.setenv(rconfig.BACKEND_ENV, "torch")
    assert make(kernel_backend="native").resolved_backend == "torch"
    monkeypatch.setenv(rconfig.BACKEND_ENV, "native")
    assert make(kernel_backend="torch").resolved_backend == "native"
    assert make().resolved_backend == "native"


def test_empty_env_is_unset(monkeypatch):
    monkeypatch.setenv(rconfig.BACKEND_ENV, "")
    assert make(kernel_backend="native").resolved_backend == "native"


def test_bad_env_value(monkeypatch):
    monkeypatch.setenv(rconfig.BACKEND_ENV, "hip")
    rejects(r"^environment EPGEN_KERNEL_BACKEND='hip': must be one of 'native', 'torch' \(or unset\)$")


def test_backend_fixed_at_construction(monkeypatch):
    c = make(kernel_backend="native")
    monkeypatch.setenv(rconfig.BACKEND_ENV, "torch")
    assert c.resolved_backend == "native"
    assert attrs.evolve(c).resolved_backend == "torch"


@pytest.mark.parametrize("field,value,message", [
    ("launch_blocks", -1, "must be >= 0"),
    ("launch_threads", -32, "must be >= 0"),
    ("launch_threads", 100, "multiple of 32"),
    ("launch_threads", 2048, "at most 1024"),
    ("launch_rows", "warp", "must be 'wave', 'block' or ''"),
    ("launch_rows", 1, "must be a str"),
])
def test_launch_geometry_override_is_validated(field, value, message):
    with pytest.raises(ConfigError, match=message):
        EpDispatchCombineConfig(rank=0, world_size=2, hidden_dim=256, max_num_inp_token_per_rank=16,
                                num_experts_per_rank=4, num_experts_per_token=2, kernel_backend="torch",
                                **{field: value})
