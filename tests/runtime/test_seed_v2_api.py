"""runtime.seed_compat's pieces one by one: the seed's config checks and how a config maps onto epgen's, the
tuning lookup, the fp4 codec of a symmetric fp4 op, the backend profiles and capability names, the
communicator, and the routing handle's tensors (forward and reverse maps, tensors() / from_tensors() round
trips) on 2 and 4 gloo ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.support.ep_dist import get_world
from runtime import ClosedError, ConfigError, InputError
from runtime.seed_compat import EpDispatchCombineConfig as Config, EpDispatchCombineOp as Op, tuning_configs
from runtime.seed_compat import EpDispatchRoutingHandle as Handle
from runtime.seed_compat.cco import Communicator
from runtime.seed_compat.config import epgen_plan
from runtime.seed_compat.op import decode_fp4, encode_fp4

BASE = dict(rank=0, world_size=2, hidden_dim=256, max_num_inp_token_per_rank=8, num_experts_per_rank=2,
            num_experts_per_token=3)
FP8, FP4 = torch.float8_e4m3fn, torch.float4_e2m1fn_x2


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    for name in ("MORI_V2_KERNEL_BACKEND", "EPGEN_KERNEL_BACKEND"):
        monkeypatch.delenv(name, raising=False)


# --- the seed's config checks ---------------------------------------------------------------------------
@pytest.mark.parametrize("kw, message", [
    (dict(dispatch_data_type=FP8), "must be set together"),
    (dict(quant_type="fp4_blockwise"), "quant_type must be one of"),
    (dict(combine_mode="pull"), "combine_mode must be gather|scatter"),
    (dict(world_size=65, rank=0), "world_size <= 64"),
    (dict(hidden_dim=100), "16 B aligned"),
    (dict(dispatch_data_type=FP8, combine_data_type=torch.bfloat16, combine_mode="scatter"), "requires combine_mode=gather"),
    (dict(dispatch_data_type=torch.bfloat16, combine_data_type=FP4), "does not support fp4"),
    (dict(data_type=torch.float16), "must be torch.bfloat16, torch.float32"),
    (dict(scale_dim=1.5), "scale_dim=1.5: must be an int"),
])
def test_seed_config_checks(kw, message):
    with pytest.raises(ConfigError, match=message):
        Config(**{**BASE, **kw})


def test_quant_switches_gather_to_scatter_and_properties_follow_the_seed():
    cfg = Config(**BASE, quant_type="fp8_blockwise")  # combine_mode defaults to "gather"
    assert cfg.combine_mode == "scatter" and cfg.is_scatter and cfg.combine_scale_dim == 2 and cfg.wire_elem_size == 1
    assert epgen_plan(cfg, "flydsl").config.resolved_combine_mode == "scatter"
    capped = Config(**BASE, max_total_recv_tokens=9)  # the seed rounds the cap up to a multiple of world_size
    assert (capped.effective_max_recv_per_rank, capped.effective_max_recv, capped.max_recv) == (5, 10, 16)
    assert epgen_plan(capped, "flydsl").config.max_recv_tokens == 10
    fp4 = Config(**BASE, data_type=FP4)
    assert (fp4.is_fp4, fp4.elem_size, fp4.token_nbytes, fp4.dtype_str) == (True, 1, 128, "fp4")
    assert Config(**BASE, dispatch_data_type=FP4, combine_data_type=torch.bfloat16).dtype_str == "fp4_disp_bf16_comb"


def test_how_seed_payloads_map_onto_epgen():
    plain = epgen_plan(Config(**BASE), "flydsl")
    assert (plain.extra_cols, plain.combine_codec, plain.config.hidden_dim) == (0, None, 256)
    scaled = epgen_plan(Config(**BASE, scale_dim=6, scale_type_size=1), "flydsl")  # 2 dwords on a bf16 row
    assert scaled.extra_cols == 8 and scaled.config.hidden_dim == 264 and scaled.config.scale_dim == 0
    blockwise = epgen_plan(Config(**BASE, scale_dim=4, scale_type_size=4, quant_type="fp8_blockwise"), "flydsl")
    assert blockwise.extra_cols == 128  # a whole quantization block of its own
    fp8 = epgen_plan(Config(**BASE, data_type=FP8), "flydsl")  # symmetric: combine in float32, rounded to fp8
    assert fp8.combine_codec == FP8 and fp8.config.combine_dtype == torch.float32 and fp8.dummy_scales
    assert (fp8.config.dispatch_data_type, fp8.config.scale_dim, fp8.config.scale_type_size) == (FP8, 1, 1)
    asym = epgen_plan(Config(**BASE, dispatch_data_type=FP8, combine_data_type=torch.bfloat16, scale_dim=8,
                             scale_type_size=1), "flydsl")
    assert asym.combine_codec is None and asym.config.combine_dtype == torch.bfloat16 and asym.config.scale_dim == 8
    with pytest.raises(ConfigError, match="bf16 <-> fp32 conversion .* not built"):
        epgen_plan(Config(**BASE, dispatch_data_type=torch.bfloat16, combine_data_type=torch.float32), "flydsl")
    with pytest.raises(ConfigError, match="gather-only"):
        epgen_plan(Config(**BASE, data_type=FP8, combine_mode="scatter"), "flydsl")
    with pytest.raises(ConfigError, match="enable_std_moe with fp8/fp4"):
        epgen_plan(Config(**BASE, data_type=FP8, enable_std_moe=True), "flydsl")


def test_backend_names_are_profiles():
    cfg = Config(**BASE)
    assert cfg.requested_backend() == "flydsl"  # the seed's default
    assert Config(**BASE, kernel_backend="hip").requested_backend() == "hip"
    with pytest.raises(ConfigError, match="unknown kernel backend 'cuda'"):
        Config(**BASE, kernel_backend="cuda").requested_backend()
    # the seed's hip backend refuses everything but the gather path, before anything is built
    for kw, why in ((dict(combine_mode="scatter"), "combine_mode='scatter'"), (dict(enable_std_moe=True), "enable_std_moe"),
                    (dict(scale_dim=4, scale_type_size=1), "per-token scales"), (dict(max_total_recv_tokens=4), "token dropping"),
                    (dict(quant_type="fp8_direct_cast"), "quant_type='fp8_direct_cast'")):
        with pytest.raises(ConfigError, match=f"hip backend cannot serve this config:(.|\\n)*{why}"):
            epgen_plan(Config(**BASE, kernel_backend="hip", **kw), "hip")
    assert epgen_plan(Config(**BASE, kernel_backend="torch"), "torch").config.kernel_backend == "torch"
    assert epgen_plan(Config(**BASE, kernel_backend="hip"), "hip").config.kernel_backend is None  # auto


def test_seed_backend_env_names_the_profile(monkeypatch):
    monkeypatch.setenv("MORI_V2_KERNEL_BACKEND", "hip")
    assert Config(**BASE).requested_backend() == "hip"
    assert Config(**BASE, kernel_backend="flydsl").requested_backend() == "flydsl"  # the field wins, as the seed


# --- tuning_configs -----------------------------------------------------------------------------------
def test_lookup_without_a_device_is_the_seeds_untuned_fallback():
    assert tuning_configs._topology() == (0, 0, 0)
    assert tuning_configs.lookup(8, 7168, 8, dtype="bf16") == dict(
        dispatch_block_num=80, combine_block_num=80, warp_num_per_block=16, combine_warp_num_per_block=4,
        schedule=None)


def test_lookup_on_a_device_is_epgens_tuning_table(monkeypatch):
    from runtime.config import load_specs

    target = load_specs().targets["sm_90"]
    monkeypatch.setattr(tuning_configs, "_device", lambda: (target, 132))
    got = tuning_configs.lookup(2, 7168, 8, dtype="fp8")
    assert got["schedule"] == ((32, 132, 2, 132, 8), (128, 132, 2, 132, 16), (512, 132, 8, 132, 16),
                               (None, 132, 16, 132, 16))
    assert (got["dispatch_block_num"], got["warp_num_per_block"], got["combine_block_num"],
            got["combine_warp_num_per_block"]) == (132, 16, 132, 16)
    cfg = Config(**BASE)
    cfg.schedule = got["schedule"]  # the seed's TUNED=1: assigned after construction
    ecfg = epgen_plan(cfg, "flydsl").config
    assert ecfg.launch_override("dispatch", 100, 32) == (132, 64)
    assert ecfg.launch_override("combine", 100, 32) == (132, 512)
    assert ecfg.launch_override("dispatch", 4096, 32) == (132, 512)


def test_tuned_constructor_fills_the_unpinned_geometry():
    cfg = Config.tuned(**BASE, combine_block_num=7)
    assert (cfg.dispatch_block_num, cfg.combine_block_num, cfg.warp_num_per_block) == (80, 7, 16)


# --- the fp4 codec of a symmetric fp4 op -----------------------------------------------------------------
def test_fp4_codec_round_trips_every_byte_and_rounds_to_nearest_even():
    every = torch.arange(256, dtype=torch.uint8).view(1, 256).view(FP4)
    values = decode_fp4(every)
    assert values.shape == (1, 512)
    assert torch.equal(encode_fp4(values).view(torch.uint8), every.view(torch.uint8))
    assert values[0, :16].tolist() == [0.0, 0.0, 0.5, 0.0, 1.0, 0.0, 1.5, 0.0, 2.0, 0.0, 3.0, 0.0, 4.0, 0.0, 6.0, 0.0]
    y = torch.tensor([[0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -0.3, -100.0, 0.26, float("nan")]])
    want = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -0.5, -6.0, 0.5, 6.0]
    assert decode_fp4(encode_fp4(y)).tolist() == [want]


# --- on gloo ranks --------------------------------------------------------------------------------------
def _inputs(rank, world, M, H, K, EPR, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(77 + rank)
    return (torch.randn(M, H, generator=g).to(dtype), torch.rand(M, K, generator=g),
            torch.randint(0, world * EPR, (M, K), generator=g, dtype=torch.int32))


def handle_maps(rank: int, world: int, cap: int) -> None:
    """The seed handle's forward and reverse maps name the same rows on both ends, and a handle made from its
    tensors (the same ones, or copies) combines and replays like the original."""
    M, H, K, EPR = 12, 64, 3, 2
    cfg = Config(rank=rank, world_size=world, hidden_dim=H, max_num_inp_token_per_rank=M, num_experts_per_rank=EPR,
                 num_experts_per_token=K, max_total_recv_tokens=cap)
    op = Op(cfg, None)
    x, w, idx = _inputs(rank, world, M, H, K, EPR)
    idx[0, 1] = idx[0, 0]  # a token naming one expert twice: one row, one map entry
    idx[1, 2] = -1  # no expert
    recv_x, _, _, _, total_t, h = op.dispatch(x, w, None, idx, return_routing=True)
    total, R = int(total_t), cfg.effective_max_recv
    fwd, inter, send, tot, rev = h.tensors()
    assert fwd.dtype == rev.dtype == torch.int32 and fwd.shape == (M * K,) and rev.shape == (R,)
    assert inter.numel() == send.numel() == 0 and tot is total_t and h.cur_rank_num_token == M
    assert torch.all(rev[total:] == -1) and torch.all(rev[:total] >= 0)
    every_rev = [torch.empty(R, dtype=torch.int32) for _ in range(world)]
    dist.all_gather(every_rev, rev)
    null = world * R
    seen = set()
    for t in range(M):
        for j in range(K):
            e = int(fwd[t * K + j])
            dest = int(idx[t, j]) // EPR if int(idx[t, j]) >= 0 else -1
            first = dest >= 0 and all(int(idx[t, jj]) // EPR != dest or int(idx[t, jj]) < 0 for jj in range(j))
            if e == null:
                assert not first or cap, (t, j)  # only a dropped row of a first id has no entry
                continue
            assert first and e // R == dest, (t, j, e)
            assert int(every_rev[dest][e % R]) == rank * M + t  # the destination's reverse map names this token
            seen.add((dest, e % R))
    counts = [0] * world
    for d, _ in seen:
        counts[d] += 1
    got = torch.tensor(counts)
    dist.all_reduce(got)
    assert int(got[rank]) == total  # every received row is named by exactly one sender entry
    out, out_w = op.combine(recv_x, w, routing=h)
    same = Handle.from_tensors(h.tensors(), cur_rank_num_token=M)  # the dispatch's own tensors: found again
    out2, out_w2 = op.combine(recv_x, w, routing=same)
    copied = Handle.from_tensors(tuple(t.clone() for t in h.tensors()), cur_rank_num_token=M)  # rebuilt
    out3, out_w3 = op.combine(recv_x, w, routing=copied)
    assert torch.equal(out, out2) and torch.equal(out, out3) and torch.equal(out_w, out_w3)
    again = op.dispatch(x, w, None, idx, routing=copied)  # replay through a rebuilt handle
    assert len(again) == 5 and torch.equal(again[0][:total], recv_x[:total]) and int(again[4]) == total
    op.close()


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("cap", [0, 10])
def test_routing_handle_maps_and_round_trips(world, cap):
    get_world(world).run(handle_maps, cap * world // 2, timeout=180)


def profiles_and_lifecycle(rank: int, world: int) -> None:
    obj = [Communicator.get_unique_id() if rank == 0 else None]
    dist.broadcast_object_list(obj, src=0)
    assert obj[0].startswith("tcp://")
    with pytest.raises(ConfigError, match="the torch.distributed default group has"):
        Communicator.init(world + 1, rank, obj[0])
    comm = Communicator.init(world, rank, obj[0], 1 << 30)
    M, H, K, EPR = 8, 64, 2, 2
    base = dict(rank=rank, world_size=world, hidden_dim=H, max_num_inp_token_per_rank=M, num_experts_per_rank=EPR,
                num_experts_per_token=K)
    hip = Op(Config(**base, kernel_backend="hip"), comm)
    fly = Op(Config(**base), comm)
    assert (hip.backend_name, fly.backend_name, hip.epgen_backend) == ("hip", "flydsl", "torch")
    assert hip.capabilities == frozenset({"gather"}) and "replay" in fly.capabilities
    assert len(comm._resources) == 4 and {r.kind for r in comm._resources} == {"memory", "window"}
    assert hip.recv_tokens().shape == (world * M, H) and hip.recv_scales() is None
    assert torch.all(hip.recv_indices() == -1) and hip.recv_weights().shape == (world * M, K)
    x, w, idx = _inputs(rank, world, M, H, K, EPR)
    *_, h = hip.dispatch(x, None, None, idx, return_routing=True)
    assert torch.equal(hip.recv_weights(), torch.zeros(world * M, K))  # the seed's arena: no weights forwarded
    with pytest.raises(NotImplementedError, match="no routing replay"):
        hip.dispatch(x, w, None, idx, routing=h)
    with pytest.raises(NotImplementedError, match="flydsl-only"):
        hip.local_expert_count()
    with pytest.raises(InputError, match="either routing= .* or return_routing=True"):
        fly.dispatch(x, w, None, idx, routing=h, return_routing=True)
    with pytest.raises(InputError, match="exceeds max_num_inp_token_per_rank"):
        fly.dispatch(torch.zeros(M + 1, H, dtype=torch.bfloat16), w, None, idx, return_routing=True)
    hip.combine(hip.recv_tokens(), routing=h)
    hip.close()
    assert len(comm._resources) == 2
    with pytest.raises(ClosedError, match="dispatch: this EpDispatchCombineOp is closed"):
        hip.dispatch(x, w, None, idx)
    comm.barrier()
    comm.destroy()  # closes what is still registered
    assert fly.closed and comm._resources == []
    with pytest.raises(ConfigError, match="destroyed"):
        comm.barrier()


def test_profiles_communicator_and_lifecycle():
    get_world(2).run(profiles_and_lifecycle, timeout=180)


def test_op_refuses_epgens_config():
    from runtime import EpDispatchCombineConfig

    with pytest.raises(ConfigError, match="the seed's config"):
        Op(EpDispatchCombineConfig(**{**BASE, "world_size": 1, "num_experts_per_rank": 3}), None)
