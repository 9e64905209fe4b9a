"""What a benchmark point runs on: its config fields (``point_config``: a plain or a pre-quantized fp8 payload,
an internode topology, a launch geometry), the fp8 payload's block scales (``quantize_blocks`` /
``dequantize_rows``) and its input sets (``make_input_sets``: token permutations of one routing, so every set
moves the same rows; bench/sweep.py's module docstring, step 2)."""

from __future__ import annotations

import math

import torch

from runtime import EpDispatchCombineConfig

FP8_PAYLOADS = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
QUANT_BLOCK = 128  # elements per float32 scale of the fp8 payload points
MAX_INPUT_SETS = 32
ROUTINGS = ("uniform", "remote")


def quantize_blocks(x: torch.Tensor, scale_dim: int, dtype=torch.float8_e4m3fn) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H] -> (fp8 [T, H], float32 scales [T, scale_dim]): one scale per H/scale_dim elements, amax/fp8 max."""
    T, H = x.shape
    blocks = x.float().view(T, scale_dim, H // scale_dim)
    scales = (blocks.abs().amax(-1) / torch.finfo(dtype).max).clamp_min(1e-12)
    return (blocks / scales[..., None]).view(T, H).to(dtype), scales


def dequantize_rows(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp8 rows [R, H] and float32 scales [R, s] -> [R, H] dtype: q * scale per block of H/s, in float32."""
    R, H = q.shape
    s = scales.shape[1]
    return (q.float().view(R, s, H // s) * scales.float()[..., None]).view(R, H).to(dtype)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def point_config(rank: int, world: int, T: int, hidden: int, k: int, num_experts: int, dtype: torch.dtype,
                 backend: str = "native", topology: dict | None = None, geometry: dict | None = None,
                 wave: int = 32) -> dict:
    """Config fields of a benchmark point; an fp8 dtype is a pre-quantized payload with per-128 fp32 scales.
    topology: extra config fields of an internode point ({"gpu_per_node": G, "internode_kernel": kind});
    geometry: launch overrides ({"launch_blocks": B, "launch_threads": N, "combine_threads": C}, zeros: the tuning
    table). A combine thread count of its own goes through the per-role fields (dispatch_block_num /
    warp_num_per_block, combine_block_num / combine_warp_num_per_block: warps of `wave` lanes), since
    launch_threads pins both roles."""
    geometry = dict(geometry or {})
    combine_threads = geometry.pop("combine_threads", 0)
    if combine_threads:
        blocks, threads = geometry.pop("launch_blocks", 0), geometry.pop("launch_threads", 0)
        if threads % wave or combine_threads % wave:
            raise ValueError(f"launch threads {threads} / combine threads {combine_threads}: not whole {wave}-lane waves")
        per_role = dict(dispatch_block_num=blocks, combine_block_num=blocks, warp_num_per_block=threads // wave,
                        combine_warp_num_per_block=combine_threads // wave)
        geometry.update({key: v for key, v in per_role.items() if v})
    kw = dict(rank=rank, world_size=world, hidden_dim=hidden, max_num_inp_token_per_rank=T,
              num_experts_per_rank=num_experts // world, num_experts_per_token=k, kernel_backend=backend,
              **(topology or {}), **geometry)
    if dtype in FP8_PAYLOADS:
        if hidden % QUANT_BLOCK:
            raise ValueError(f"an {dtype_name(dtype)} payload point needs hidden % {QUANT_BLOCK} == 0, got {hidden}")
        kw.update(data_type=torch.bfloat16, dispatch_data_type=dtype, combine_data_type=torch.bfloat16,
                  scale_dim=hidden // QUANT_BLOCK, scale_type_size=4)
    else:
        kw.update(data_type=dtype)
    return kw


def make_input_sets(cfg: EpDispatchCombineConfig, n_sets: int, seed: int, device,
                    routing: str = "uniform") -> list[dict]:
    """`n_sets` input sets {x, w, scales, idx} of this rank: fresh payloads and weights; routings that
    are token permutations of one routing of k distinct experts per token, so every set moves the same
    rows per (source, destination) rank. routing="uniform": the k experts uniform over all experts;
    "remote": uniform over the other ranks' experts only (no row stays on its rank: the link alone)."""
    T, H, k, E = cfg.max_num_inp_token_per_rank, cfg.hidden_dim, cfg.num_experts_per_token, cfg.num_experts
    if routing not in ROUTINGS:
        raise ValueError(f"routing must be one of {', '.join(ROUTINGS)}, got {routing!r}")
    epr = cfg.num_experts_per_rank
    if routing == "remote" and k > E - epr:
        raise ValueError(f"routing='remote' needs k <= the other ranks' experts ({E - epr}), got k={k}")
    g = torch.Generator(device=device).manual_seed(seed)
    scores = torch.rand(T, E, device=device, generator=g)
    if routing == "remote":
        scores[:, cfg.rank * epr:(cfg.rank + 1) * epr] = -1.0  # never among the top k
    idx0 = scores.topk(k, dim=1).indices.to(torch.int32)
    sets = []
    for _ in range(n_sets):
        perm = torch.randperm(T, device=device, generator=g)
        x = torch.randn(T, H, device=device, generator=g).to(cfg.data_type)
        w = torch.rand(T, k, device=device, generator=g)
        scales = None
        if cfg.prequantized:
            x, scales = quantize_blocks(x, cfg.scale_dim, cfg.dispatch_dtype)
        sets.append({"x": x, "w": w, "scales": scales, "idx": idx0[perm].contiguous()})
    return sets


def auto_input_sets(bytes_per_set: int, device) -> int:
    """Input sets whose bytes together are at least twice the device's L2 (2..MAX_INPUT_SETS); 2 on a CPU."""
    if torch.device(device).type != "cuda":
        return 2
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or (50 << 20)
    return max(2, min(MAX_INPUT_SETS, math.ceil(2 * l2 / max(1, bytes_per_set))))
