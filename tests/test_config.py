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
               "scale_type_size", "combine_mode", "quant_type", "enable_std_moe", "max_total_recv_tokens",
               "gpu_per_node", "internode_kernel", "internode_auto_ll_max_tokens", "kernel_backend")


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
    assert (c.scale_dim, c.scale_type_size, c.combine_mode, c.quant_type) == (0, 0, "gather", "none")
    assert (c.enable_std_moe, c.max_total_recv_tokens, c.gpu_per_node) == (False, 0, 0)
    assert (c.internode_kernel, c.internode_auto_ll_max_tokens, c.kernel_backend) == ("auto", 512, None)


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
              "internode_auto_ll_max_tokens")


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


@pytest.mark.parametrize("field", ["scale_dim", "scale_type_size", "max_total_recv_tokens", "gpu_per_node"])
def test_non_negative_fields(field):
    rejects(f"^{field}=-1: must be >= 0$", **{field: -1})


@pytest.mark.parametrize("rank", [-1, 2, 7])
def test_rank_range(rank):
    rejects(rf"^rank={rank}: must be in \[0, world_size=2\)$", rank=rank)


@pytest.mark.parametrize("field,value,msg", [
    ("combine_mode", 1, "must be a str"),
    ("quant_type", None, "must be a str"),
    ("internode_kernel", b"v2", "must be a str"),
    ("enable_std_moe", 1, "must be a bool"),
    ("kernel_backend", 3, "must be a str or None"),
    ("data_type", "bfloat16", "must be a torch.dtype"),
    ("dispatch_data_type", "bf16", "must be a torch.dtype or None"),
    ("combine_data_type", 16, "must be a torch.dtype or None"),
])
def test_other_types(field, value, msg):
    rejects(f"^{field}={re.escape(repr(value))}: {msg}$", **{field: value})


def test_world_size_multiple_of_gpu_per_node():
    rejects(r"^gpu_per_node=4: world_size=6 must be a multiple of gpu_per_node$", world_size=6, gpu_per_node=4)


def test_max_total_recv_tokens_at_most_worst_case():
    make(max_total_recv_tokens=32)
    rejects(r"^max_total_recv_tokens=33: must be <= the worst case world_size \* max_num_inp_token_per_rank = 32",
            max_total_recv_tokens=33)


# --- names ------------------------------------------------------------------------------------
def test_combine_mode_names():
    rejects(r"^combine_mode='sum': must be one of 'gather', 'scatter'$", combine_mode="sum")
    rejects(r"^combine_mode='scatter': not built yet; built: 'gather'$", combine_mode="scatter")


def test_quant_type_names_from_specs():
    names = ", ".join(repr(q) for q in gspecs.load().quants)
    rejects(f"^quant_type='int4': must be one of {re.escape(names)} \\(specs/quant.toml\\)$", quant_type="int4")


@pytest.mark.parametrize("quant", [q for q in gspecs.load().quants if q != "none"])
def test_quant_types_not_built_yet(quant):
    rejects(f"^quant_type='{quant}': not built yet; built: 'none'$", quant_type=quant)


def test_internode_kernel_names():
    rejects(r"^internode_kernel='v3': must be one of 'v2', 'v2_ll', 'auto'$", internode_kernel="v3")


def test_kernel_backend_names():
    rejects(r"^kernel_backend='cuda': must be one of 'native', 'torch' or None$", kernel_backend="cuda")


# --- dtypes -----------------------------------------------------------------------------------
def test_unknown_dtype():
    rejects(r"^data_type=torch.float16: unknown dtype; supported in this release: torch.bfloat16, torch.float32$",
            data_type=torch.float16)
    rejects(r"^dispatch_data_type=torch.int8: unknown dtype", dispatch_data_type=torch.int8,
            combine_data_type=torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float4_e2m1fn_x2])
def test_fp8_fp4_payloads_not_built_yet(dtype):
    with pytest.raises(ConfigError) as err:
        make(data_type=dtype)
    msg = str(err.value)
    # a spec rule may reject it first (then with the rule's own words), else the release says not yet
    rule_msgs = {f"{r.name}: {r.message}" for r in gspecs.load().rules}
    assert msg in rule_msgs or re.match(
        rf"^data_type={re.escape(str(dtype))}: not supported in this release \(fp8/fp4 payloads are not built "
        r"yet\); supported: torch.bfloat16, torch.float32$", msg), msg


def test_float32_payload():
    assert make(data_type=torch.float32).combine_dtype is torch.float32


def test_dispatch_and_combine_dtypes_both_or_neither():
    rejects(r"^dispatch_data_type=torch.bfloat16, combine_data_type=None: set both or neither$",
            dispatch_data_type=torch.bfloat16)
    rejects(r"^dispatch_data_type=None, combine_data_type=torch.float32: set both or neither$",
            combine_data_type=torch.float32)
    c = make(dispatch_data_type=torch.bfloat16, combine_data_type=torch.bfloat16)
    assert c.dispatch_dtype is c.combine_dtype is torch.bfloat16


def test_wire_dtype_conversion_not_built_yet():
    rejects(r"^dispatch_data_type=torch.float32: must equal data_type=torch.bfloat16 in this release "
            r"\(dtype conversion on the wire is not built yet\)$",
            dispatch_data_type=torch.float32, combine_data_type=torch.bfloat16)
    rejects(r"^combine_data_type=torch.float32: must equal data_type",
            dispatch_data_type=torch.bfloat16, combine_data_type=torch.float32)


@pytest.mark.parametrize("field", ["scale_dim", "scale_type_size"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_scales_zero_for_float_payloads(field, dtype):
    rejects(rf"^{field}=4: must be 0 for a {re.escape(str(dtype))} payload \(scales are for fp8/fp4 payloads\)$",
            data_type=dtype, **{field: 4})


# --- not built yet ----------------------------------------------------------------------------
def test_std_moe_not_built_yet():
    rejects(r"^enable_std_moe=True: standard-MoE layout conversion is not built yet$", enable_std_moe=True)


@pytest.mark.parametrize("kernel", ["v2", "v2_ll", "auto"])
def test_internode_not_built_yet(kernel):
    c_kw = dict(world_size=16, gpu_per_node=8, internode_kernel=kernel)
    rejects(r"^world_size=16 > gpu_per_node=8: internode is not built yet", **c_kw)


# --- spec rules (the generator's rule engine, the spec's own words) -----------------------------
@pytest.mark.parametrize("kernel", ["v2", "v2_ll", "auto"])
@pytest.mark.parametrize("quant", [q for q in gspecs.load().quants if q != "none"])
def test_internode_quant_rule(kernel, quant):
    r = rule("internode_quant_none")
    err = rejects(None, world_size=16, gpu_per_node=8, internode_kernel=kernel, quant_type=quant)
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
