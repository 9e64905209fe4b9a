"""Argument checks of the op's calls: a tensor's type, shape, dtype, device and layout, a routing handle's origin.
Each failure is one InputError naming the call and the argument."""

from __future__ import annotations

import torch

from .errors import InputError
from .routing import RoutingHandle


def tensor(call: str, name: str, t, dtype: torch.dtype, device: torch.device, *, ndim: int | None = None,
           shape=None) -> None:
    """t is a contiguous torch.Tensor of `dtype` on `device`, of `shape` (or of `ndim` dimensions)."""
    if isinstance(t, torch.Tensor) and t.dtype == dtype and t.device == device and \
            (t.shape == shape if shape is not None else ndim is None or t.dim() == ndim) and t.is_contiguous():
        return  # every eager call checks several tensors: the passing case in one expression
    if not isinstance(t, torch.Tensor):
        raise InputError(f"{call}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise InputError(f"{call}: {name} must have shape {list(shape)}, got {list(t.shape)}")
    if ndim is not None and t.dim() != ndim:
        raise InputError(f"{call}: {name} must be {ndim}-D, got shape {list(t.shape)}")
    if t.dtype != dtype:
        raise InputError(f"{call}: {name} must be {dtype}, got {t.dtype}")
    if t.device != device:
        raise InputError(f"{call}: {name} must be on {device}, got {t.device}")
    if not t.is_contiguous():
        raise InputError(f"{call}: {name} must be contiguous")


def handle(call: str, routing, op_uid: int, config_key) -> None:
    """routing is a RoutingHandle made by the op `op_uid` for the config `config_key`."""
    if not isinstance(routing, RoutingHandle):
        raise InputError(f"{call}: routing must be a RoutingHandle, got {type(routing).__name__}")
    if routing.op_uid != op_uid:
        raise InputError(f"{call}: routing handle comes from another op (uid {routing.op_uid}, this op is "
                         f"uid {op_uid}); use the handle returned by this op's dispatch")
    if routing.config_key != config_key:
        raise InputError(f"{call}: routing handle was made for a different config (stale handle)")


def dispatch_inputs(cfg, device: torch.device, x, weights, scales, indices) -> int:
    """dispatch's tensors for this config (docs: runtime/op.py, the payload modes); returns the token count."""
    k, cols = cfg.num_experts_per_token, cfg.dispatch_payload_cols
    tensor("dispatch", "x", x, cfg.dispatch_dtype, device, ndim=2)
    num_tokens = x.shape[0]
    if x.shape[1] != cols:
        width = f"hidden_dim={cols}" if cols == cfg.hidden_dim else \
            f"hidden_dim // 2={cols} (two {cfg.dispatch_dtype} values per byte)"
        raise InputError(f"dispatch: x must have shape [num_tokens, {width}], got {tuple(x.shape)}")
    if num_tokens > cfg.max_num_inp_token_per_rank:
        raise InputError(f"dispatch: x has {num_tokens} tokens, more than max_num_inp_token_per_rank="
                         f"{cfg.max_num_inp_token_per_rank}")
    tensor("dispatch", "indices", indices, torch.int32, device, shape=(num_tokens, k))
    if weights is not None:
        tensor("dispatch", "weights", weights, torch.float32, device, shape=(num_tokens, k))
    scales_dtype = cfg.dispatch_scales_dtype
    if scales_dtype is None and scales is not None:
        why = f"dispatch_quant_type={cfg.dispatch_quant_type!r} makes the scales" \
            if cfg.dispatch_quant_type != "none" else "scale_dim=0"
        raise InputError(f"dispatch: scales must be None for a {cfg.dispatch_dtype} payload ({why})")
    if scales_dtype is not None:
        if scales is None:
            raise InputError(f"dispatch: scales are required for a {cfg.dispatch_dtype} payload: pass "
                             f"[num_tokens, scale_dim={cfg.scale_dim}] {scales_dtype}")
        tensor("dispatch", "scales", scales, scales_dtype, device, shape=(num_tokens, cfg.scale_dim))
    return num_tokens


def combine_inputs(cfg, device: torch.device, expert_out, weights, indices) -> None:
    """combine's tensors for this config: expert_out [rows <= max_recv_tokens, hidden_dim] in the combine dtype,
    weights / indices (either may be None) [rows, k]."""
    rows_max, k = cfg.max_recv_tokens, cfg.num_experts_per_token
    tensor("combine", "expert_out", expert_out, cfg.combine_dtype, device, ndim=2)
    if expert_out.shape[1] != cfg.hidden_dim or expert_out.shape[0] > rows_max:
        raise InputError(f"combine: expert_out must have shape [rows <= max_recv_tokens={rows_max}, "
                         f"hidden_dim={cfg.hidden_dim}], got {tuple(expert_out.shape)}")
    for name, t, dtype in (("weights", weights, torch.float32), ("indices", indices, torch.int32)):
        if t is None:
            continue
        tensor("combine", name, t, dtype, device, ndim=2)
        if t.shape[1] != k or t.shape[0] > rows_max:
            raise InputError(f"combine: {name} must have shape [rows <= max_recv_tokens={rows_max}, "
                             f"num_experts_per_token={k}], got {tuple(t.shape)}")
