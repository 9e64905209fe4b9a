"""The seed library's EPv2 API (amd-mori 1.2.4, mori.ops.dispatch_combine_v2) on epgen.

The seed's public names and signatures are written out below as facts (read from its Python source);
the tests hold epgen's config and op against them, and run seed-style calls on the torch backend over
two gloo ranks. docs/SEED_COMPAT.md is the prose version.
"""

from __future__ import annotations

import inspect
import types

import pytest
import torch

from tests.support.ep_dist import get_world
from tests.support.ep_oracle import make_inputs, multiplicity
from runtime import ConfigError, EpDispatchCombineConfig, EpDispatchCombineOp, InputError, seed_compat
from runtime import config as rconfig

# --- facts: the seed's EpDispatchCombineConfig fields and their defaults --------------------------
# (the EPv2 source's dataclass; the 1.2.4 additions gpu_per_node .. max_token_type_size as issue 17
# lists them, their defaults the seed's v1 config's where the EPv2 source was not at hand)
SEED_CONFIG_FIELDS = {
    "rank": "required", "world_size": "required", "hidden_dim": "required",
    "max_num_inp_token_per_rank": "required", "num_experts_per_rank": "required",
    "num_experts_per_token": "required",
    "data_type": torch.bfloat16, "dispatch_data_type": None, "combine_data_type": None,
    "scale_dim": 0, "scale_type_size": 0, "combine_mode": "gather", "quant_type": "none",
    "dispatch_block_num": None, "combine_block_num": None, "warp_num_per_block": None,
    "combine_warp_num_per_block": None, "schedule": None, "enable_std_moe": False,
    "max_total_recv_tokens": 0, "kernel_backend": None, "gpu_per_node": None,
    "internode_kernel": "auto", "internode_auto_ll_max_tokens": 512, "num_qp_per_pe": 1,
    "dispatch_rdma_block_num": None, "combine_rdma_block_num": None, "max_token_type_size": 0,
}
# its public properties (and the classmethod tuned)
SEED_CONFIG_PROPERTIES = (
    "is_scatter", "fp8_direct_cast", "fp8_blockwise", "combine_scale_dim", "wire_elem_size", "dispatch_dtype",
    "is_fp4", "is_fp8", "elem_size", "token_nbytes", "combine_dtype", "combine_elem_size", "combine_token_nbytes",
    "is_asymmetric_dtype", "dtype_str", "max_recv", "effective_max_recv_per_rank", "effective_max_recv",
    "is_internode", "nodes",
)
# the seed op's public methods: name -> signature (self omitted)
SEED_OP_METHODS = {
    "__init__": "(cfg, comm)",
    "dispatch": "(input, weights, scales, indices, *, routing=None, return_routing=False)",
    "combine": "(input, weights=None, indices=None, *, routing)",
    "available_backends": "()",  # classmethod
    "scale_stride_bytes": "()",
    "close": "()",
    "reset": "()",
    "convert_dispatch_output": "()",
    "convert_combine_input": "(routing)",
    "combine_in_view": "()",
    "local_expert_count": "()",
    "recv_tokens": "()",
    "recv_weights": "()",
    "recv_indices": "()",
    "recv_scales": "()",
}
SEED_OP_ATTRIBUTES = ("cfg", "capabilities", "backend_name")
# the seed's routing handle: its constructor, attributes and methods
SEED_HANDLE_INIT = ("(disp_dest_tok_id_map, inter_node_disp_dest_tok_id_map, inter_node_disp_send_map, "
                    "total_recv_token_num, disp_tok_id_to_src_tok_id_local=None, cur_rank_num_token=0)")
SEED_HANDLE_ATTRIBUTES = ("disp_dest_tok_id_map", "inter_node_disp_dest_tok_id_map", "inter_node_disp_send_map",
                          "total_recv_token_num", "disp_tok_id_to_src_tok_id_local", "cur_rank_num_token")

BASE = dict(rank=0, world_size=2, hidden_dim=64, max_num_inp_token_per_rank=8, num_experts_per_rank=2,
            num_experts_per_token=3, kernel_backend="torch")


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    monkeypatch.delenv(rconfig.BACKEND_ENV, raising=False)


def test_every_seed_field_is_epgen_field_alias_or_ignored():
    epgen = set(rconfig.FIELDS)
    for name in SEED_CONFIG_FIELDS:
        assert name in epgen, f"the seed's config field {name!r} is not accepted"
    mapped = {n for n in SEED_CONFIG_FIELDS if n in seed_compat.SEED_FIELDS}
    assert mapped == set(seed_compat.SEED_FIELDS)
    assert {kind for kind, _ in seed_compat.SEED_FIELDS.values()} == {"alias", "ignored"}


def test_seed_defaults_construct():
    """A config with every optional field at the seed's default value is valid on epgen."""
    seed_defaults = {n: v for n, v in SEED_CONFIG_FIELDS.items() if v != "required"}
    cfg = EpDispatchCombineConfig(**{**BASE, **seed_defaults, "kernel_backend": "torch"})
    assert cfg.gpu_per_node == 0 and cfg.nodes == 1 and not cfg.is_internode
    assert cfg.launch_override("dispatch", 1, 64) == (0, 0)  # nothing pinned: specs/tuning.toml


def test_seed_properties_exist_and_match_the_seed_formulas():
    for name in SEED_CONFIG_PROPERTIES:
        assert hasattr(EpDispatchCombineConfig, name), name
    assert callable(EpDispatchCombineConfig.tuned)
    c = EpDispatchCombineConfig(**{**BASE, "max_total_recv_tokens": 9})
    assert (c.max_recv, c.effective_max_recv, c.effective_max_recv_per_rank) == (16, 9, 5)
    assert (c.elem_size, c.token_nbytes, c.combine_token_nbytes, c.dtype_str) == (2, 128, 128, "bf16")
    assert not (c.is_fp8 or c.is_fp4 or c.is_scatter or c.is_asymmetric_dtype)
    fp4 = EpDispatchCombineConfig(**{**BASE, "dispatch_data_type": torch.float4_e2m1fn_x2,
                                     "combine_data_type": torch.bfloat16, "scale_dim": 2, "scale_type_size": 1})
    assert (fp4.is_fp4, fp4.elem_size, fp4.token_nbytes, fp4.dtype_str) == (True, 1, 32, "fp4_disp_bf16_comb")
    q = EpDispatchCombineConfig(**{**BASE, "hidden_dim": 256, "quant_type": "fp8_blockwise"})
    assert (q.is_scatter, q.fp8_blockwise, q.combine_scale_dim, q.wire_elem_size) == (True, True, 2, 1)
    inter = EpDispatchCombineConfig(**{**BASE, "world_size": 4, "gpu_per_node": 2})
    assert (inter.nodes, inter.is_internode) == (2, True)
    assert EpDispatchCombineConfig.tuned(**BASE) == EpDispatchCombineConfig(**BASE)


def _binds(fn, call: str):
    args, kwargs = eval(f"(lambda *a, **k: (a, k)){call}", {})  # noqa: S307 - the test's own literals
    inspect.signature(fn).bind(*args, **kwargs)


def test_epgen_op_takes_the_seed_call_forms():
    cls = EpDispatchCombineOp
    for name in ("dispatch", "combine", "available_backends", "scale_stride_bytes", "close", "reset",
                 "convert_dispatch_output", "combine_in_view", "local_expert_count"):
        assert hasattr(cls, name), name
    for name in SEED_OP_ATTRIBUTES:
        assert isinstance(inspect.getattr_static(cls, name), property), name
    assert isinstance(inspect.getattr_static(cls, "available_backends"), classmethod)
    assert "torch" in cls.available_backends()
    op = object.__new__(cls)
    _binds(cls.__init__, "(None, 'cfg', 'comm')")
    _binds(op.dispatch, "('x', 'w', None, 'i')")
    _binds(op.dispatch, "(input='x', weights='w', scales=None, indices='i', routing='h')")
    _binds(op.dispatch, "('x', 'w', None, 'i', return_routing=True)")
    _binds(op.combine, "('y', routing='h')")
    _binds(op.combine, "('y', 'w', 'i', routing='h')")
    _binds(op.combine, "(input='y', weights='w', indices='i', routing='h')")
    # epgen's own names keep working
    _binds(op.dispatch, "(x='x', weights='w', scales=None, indices='i', return_routing=True, routing=None)")
    _binds(op.combine, "(expert_out='y', weights='w', indices='i', routing='h')")


def test_seed_op_has_the_seed_signatures():
    cls = seed_compat.EpDispatchCombineOp
    for name, sig in SEED_OP_METHODS.items():
        fn = inspect.getattr_static(cls, name)
        fn = fn.__func__ if isinstance(fn, classmethod) else fn
        params = list(inspect.signature(fn).parameters.values())
        got = str(inspect.Signature(params[1:]))  # self / cls omitted
        assert got == sig, f"{name}{got} != the seed's {name}{sig}"
    for name in SEED_OP_ATTRIBUTES:
        assert isinstance(inspect.getattr_static(cls, name), property), name
    assert isinstance(inspect.getattr_static(cls, "available_backends"), classmethod)
    assert cls.available_backends() == ["flydsl", "hip"]
    handle = seed_compat.EpDispatchRoutingHandle
    params = list(inspect.signature(handle.__init__).parameters.values())[1:]
    assert str(inspect.Signature([p for p in params if not p.name.startswith("_")])) == SEED_HANDLE_INIT
    h = handle(*range(5), cur_rank_num_token=3)
    assert [getattr(h, a) for a in SEED_HANDLE_ATTRIBUTES] == [0, 1, 2, 3, 4, 3]
    assert h.tensors() == (0, 1, 2, 3, 4)
    again = handle.from_tensors(h.tensors(), cur_rank_num_token=3)
    assert again.tensors() == h.tensors() and again.cur_rank_num_token == 3


def test_seed_config_has_the_seed_fields_defaults_and_order():
    import dataclasses

    cls = seed_compat.EpDispatchCombineConfig
    fields = dataclasses.fields(cls)
    assert [f.name for f in fields] == list(SEED_CONFIG_FIELDS)
    for f in fields:
        want = SEED_CONFIG_FIELDS[f.name]
        assert (f.default is dataclasses.MISSING) if want == "required" else f.default == want, f.name
    cfg = cls(0, 2, 256, 8, 2, 3)  # positional, as the seed's dataclass
    cfg.schedule = ((None, 1, 1, 1, 1),)  # mutable, as the seed's (the op snapshots it)
    for name in SEED_CONFIG_PROPERTIES:
        assert hasattr(cfg, name), name


def test_seed_module_exports_the_seed_names():
    assert seed_compat.EpDispatchCombineConfig is not EpDispatchCombineConfig  # the seed's own class
    assert not issubclass(seed_compat.EpDispatchCombineOp, EpDispatchCombineOp)  # it wraps epgen's op
    assert {"EpDispatchCombineConfig", "EpDispatchCombineOp", "EpDispatchRoutingHandle"} <= set(seed_compat.__all__)
    from runtime.seed_compat import cco, hip_tuning_configs, tuning_configs  # the seed's module layout

    assert callable(tuning_configs.lookup) and callable(tuning_configs._topology)
    assert callable(hip_tuning_configs.lookup) and callable(cco.Communicator.init)


# --- field decisions ------------------------------------------------------------------------------
def test_seed_geometry_maps_per_role_and_schedule():
    c = EpDispatchCombineConfig(**{**BASE, "dispatch_block_num": 64, "warp_num_per_block": 16,
                                   "combine_block_num": 80, "combine_warp_num_per_block": 4})
    assert c.launch_override("dispatch", 100, 64) == (64, 1024)
    assert c.launch_override("combine", 100, 64) == (80, 256)
    assert c.launch_override("combine", 100, 32) == (80, 128)  # warps x the device's wave
    s = EpDispatchCombineConfig(**{**BASE, "schedule": [[8, 16, 4, 32, 8], [None, 64, 16, 80, 4]]})
    assert s.schedule == ((8, 16, 4, 32, 8), (None, 64, 16, 80, 4))  # lists -> tuples: hashable
    assert s.launch_override("dispatch", 8, 64) == (16, 256)
    assert s.launch_override("dispatch", 9, 64) == (64, 1024)
    assert s.launch_override("combine", 1, 32) == (32, 256)
    assert s.launch_thread_overrides("combine", 64) == {512, 256}
    pinned = EpDispatchCombineConfig(**{**BASE, "schedule": ((None, 64, 16, 80, 4),), "combine_block_num": 7})
    assert pinned.launch_override("combine", 1, 64) == (7, 256)  # a pinned field beats the schedule (the seed's rule)
    assert hash(s.key)


def test_native_launch_takes_the_seed_geometry():
    from runtime.backends.native import NativeBackend

    cfg = EpDispatchCombineConfig(**{**BASE, "combine_block_num": 40, "combine_warp_num_per_block": 8})
    kern = {"combine": types.SimpleNamespace(blocks_per_sm=lambda t: 2, max_threads=1024, symbol="combine"),
            "dispatch": types.SimpleNamespace(blocks_per_sm=lambda t: 2, max_threads=1024)}
    fake = types.SimpleNamespace(arch="gfx950", num_sms=256, wave=64, _dispatch_converts=False, config=cfg, k=kern)
    assert NativeBackend._geometry(fake, "combine", 16, 16) == (40, 512)
    NativeBackend._check_geometry(fake)
    kern["combine"].max_threads = 256
    with pytest.raises(Exception, match="the config's launch geometry: 512 threads"):
        NativeBackend._check_geometry(fake)


@pytest.mark.parametrize("kw, message", [
    (dict(dispatch_block_num=0), "dispatch_block_num=0: must be >= 1"),
    (dict(warp_num_per_block=2.0), "must be an int or None"),
    (dict(num_qp_per_pe=-1), "num_qp_per_pe=-1: must be >= 0"),
    (dict(schedule=((8, 16, 4),)), "schedule=.*must be a non-empty sequence"),
    (dict(schedule=()), "schedule=.*must be a non-empty sequence"),
    (dict(dispatch_block_num=64, launch_blocks=32), "both set: pick one"),
    (dict(kernel_backend="cco"), "kernel_backend='cco': must be one of"),
])
def test_seed_fields_are_validated(kw, message):
    with pytest.raises(ConfigError, match=message):
        EpDispatchCombineConfig(**{**BASE, **kw})


def test_ignored_fields_change_nothing_but_the_key():
    plain = EpDispatchCombineConfig(**BASE)
    knobs = EpDispatchCombineConfig(**{**BASE, "num_qp_per_pe": 4, "dispatch_rdma_block_num": 32,
                                       "combine_rdma_block_num": 16, "max_token_type_size": 2})
    for name in ("max_recv_tokens", "topology_names", "resolved_backend", "token_nbytes"):
        assert getattr(plain, name) == getattr(knobs, name)
    assert knobs.launch_override("dispatch", 1, 64) == (0, 0)


def test_seed_backend_names_and_gpu_per_node_none():
    c = EpDispatchCombineConfig(**{**BASE, "kernel_backend": "hip", "gpu_per_node": None})
    assert (c.kernel_backend, c.gpu_per_node) == ("native", 0)
    assert EpDispatchCombineConfig(**{**BASE, "kernel_backend": "flydsl"}).kernel_backend == "native"


def test_op_refuses_a_non_process_group_comm():
    cfg = EpDispatchCombineConfig(**{**BASE, "world_size": 1, "num_experts_per_rank": 3})  # one rank: k experts
    with pytest.raises(ConfigError, match="ProcessGroup or None"):
        EpDispatchCombineOp(cfg, object())
    with pytest.raises(ConfigError, match="combine_weights='sum'"):
        EpDispatchCombineOp(cfg, combine_weights="sum")


# --- seed-style calls on two gloo ranks (torch backend) --------------------------------------------
def seed_round(rank: int, world: int, seed: int, counts) -> None:
    """The seed's identity-expert check (its test_op.py): combine[t] == U[t] * input[t] and, with the
    weight fold requested by passing the local weights, out_weights[t] == U[t] * wts[t]."""
    from runtime.seed_compat import EpDispatchCombineConfig as Config, EpDispatchCombineOp as Op

    cfg = Config(rank=rank, world_size=world, hidden_dim=64, max_num_inp_token_per_rank=8, num_experts_per_rank=2,
                 num_experts_per_token=3, data_type=torch.bfloat16, gpu_per_node=None, dispatch_block_num=64,
                 combine_block_num=80, warp_num_per_block=16, combine_warp_num_per_block=4, num_qp_per_pe=1,
                 kernel_backend="torch")
    op = Op(cfg, None)
    inputs = [make_inputs(seed, r, counts[r], cfg.hidden_dim, 3, cfg.num_experts_per_rank * world, torch.bfloat16)
              for r in range(world)]
    inp, wts, idx = inputs[rank]
    ct = inp.shape[0]
    recv_x, out_w, out_s, out_i, total_recv, routing = op.dispatch(inp, wts, None, idx, return_routing=True)
    assert recv_x.shape == (cfg.effective_max_recv, cfg.hidden_dim) and out_s is None
    assert op.scale_stride_bytes() == 0 and op.cfg is cfg
    u = torch.tensor(multiplicity(idx, cfg.num_experts_per_rank), dtype=torch.float32).unsqueeze(1)
    out, out_weights = op.combine(recv_x, wts[:ct], routing=routing)  # the seed's call: a fold request
    assert torch.equal(out, (u * inp.float()).to(torch.bfloat16))
    assert torch.equal(out_weights, u * wts), "the weight fold is not U * wts"
    out2, none = op.combine(input=recv_x, routing=routing)
    assert torch.equal(out2, out) and none is None
    # replay with the handle, as the seed's routing=, then the fold again
    op.dispatch(input=inp, weights=wts, scales=None, indices=idx, routing=routing)
    _, again = op.combine(recv_x, torch.zeros_like(wts), idx, routing=routing)  # values passed are unused
    assert torch.equal(again, u * wts)
    # epgen's own op: weights are values, summed per token (dispatch's out_weights give the same fold)
    mine = EpDispatchCombineOp(EpDispatchCombineConfig(
        rank=rank, world_size=world, hidden_dim=64, max_num_inp_token_per_rank=8, num_experts_per_rank=2,
        num_experts_per_token=3, data_type=torch.bfloat16, gpu_per_node=None, dispatch_block_num=64,
        combine_block_num=80, warp_num_per_block=16, combine_warp_num_per_block=4, num_qp_per_pe=1,
        kernel_backend="torch"))
    recv_x, out_w, _, _, _, h = mine.dispatch(inp, wts, None, idx, return_routing=True)
    _, summed = mine.combine(recv_x, out_w, routing=h)
    assert torch.equal(summed, u * wts)
    _, doubled = mine.combine(expert_out=recv_x, weights=2 * out_w, routing=h)
    assert torch.equal(doubled, 2 * u * wts)
    op.close()
    mine.close()


def seed_fold_needs_dispatch_weights(rank: int, world: int) -> str:
    from runtime.seed_compat import EpDispatchCombineConfig as Config, EpDispatchCombineOp as Op

    op = Op(Config(rank=rank, world_size=world, hidden_dim=64, max_num_inp_token_per_rank=4, num_experts_per_rank=2,
                   num_experts_per_token=2, kernel_backend="torch"), None)
    x = torch.ones(2, 64, dtype=torch.bfloat16)
    idx = torch.tensor([[0, 2], [1, 3]], dtype=torch.int32)
    recv_x, *_, h = op.dispatch(x, None, None, idx, return_routing=True)
    try:
        op.combine(recv_x, torch.ones(2, 2), routing=h)
    except InputError as e:
        return str(e)
    finally:
        op.combine(recv_x, routing=h)  # keep the ranks in step
        op.close()
    return ""


@pytest.mark.parametrize("counts", [(5, 8), (0, 3)])
def test_seed_style_round_trip_on_two_gloo_ranks(counts):
    get_world(2).run(seed_round, 7, counts)


def test_seed_fold_without_dispatch_weights_says_why():
    for message in get_world(2).run(seed_fold_needs_dispatch_weights):
        assert "the last dispatch had weights=None" in message
