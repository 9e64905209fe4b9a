"""The check of runtime.integrations.torchtitan against the real client (issue 36, item 4): torchtitan 0.3.0's own MoE
module (torchtitan/models/common/moe.py: router, routed experts = token dispatcher + GroupedExperts) built twice on
the EP group, once with torchtitan's ``AllToAllTokenDispatcher`` and once with ``EpgenTokenDispatcher``, the same
weights and tokens; the outputs and the gradients of the tokens, the router and the local experts are compared.

``compare(...)`` runs on every rank of an initialised process group (gloo on CPU; on GPUs the group the GPU tests
join) and returns this rank's relative errors, ``||epgen - reference|| / ||reference||`` per tensor (float64 norms).
Routing is steered with the router's ``expert_bias_E`` (used for choosing experts only, as in torchtitan's
auxiliary-loss-free balancing; the scores stay the router's): ``starve_rank`` leaves the last rank's experts, and
``starve_expert`` one more expert, without tokens.

torchtitan's reference runs with ``parallelism.spmd_backend = "partial_dtensor"``: its default "spmd_types" moves the
tokens with the list form of ``dist.all_to_all``, which gloo refuses for unequal chunks.
"""

from __future__ import annotations

import importlib.util
import os

import torch
import torch.distributed as dist

INSTALL = 'pip install --no-deps torchtitan==0.3.0 && pip install spmd_types==0.2.3 tyro triton'
REQUIRE_ENV = "EPGEN_REQUIRE_TORCHTITAN"  # set (scripts/test.sh): a missing torchtitan fails instead of skipping


def torchtitan_missing() -> str | None:
    """None when torchtitan's MoE and the integration import here, else why not (the skip reason)."""
    if importlib.util.find_spec("torchtitan") is None:
        return f"torchtitan is not installed ({INSTALL}; or pip install 'epgen[torchtitan]')"
    try:
        import runtime.integrations.torchtitan  # noqa: F401  (installs the torch 2.11 shim first)
        import torchtitan.models.common.moe  # noqa: F401
    except Exception as e:  # noqa: BLE001 - a partial install names what is missing
        return f"torchtitan does not import: {type(e).__name__}: {e} ({INSTALL})"
    return None


def build_moe(dispatcher_config, *, dim: int, inter: int, experts: int, top_k: int, world: int):
    """torchtitan's MoE (sigmoid router, normalised and scaled scores, bias-steered choice) holding this rank's
    experts (experts // world of them), with the given dispatcher config."""
    from torchtitan.models.common.linear import Linear
    from torchtitan.models.common.moe import MoE, GroupedExperts, RoutedExperts, TokenChoiceTopKRouter

    cfg = MoE.Config(
        num_experts=experts,
        routed_experts=RoutedExperts.Config(
            inner_experts=GroupedExperts.Config(dim=dim, hidden_dim=inter, num_experts=experts // world),
            token_dispatcher=dispatcher_config),
        router=TokenChoiceTopKRouter.Config(num_experts=experts, gate=Linear.Config(in_features=dim, out_features=experts),
                                            top_k=top_k, score_func="sigmoid", route_norm=True, route_scale=2.5),
        load_balance_coeff=1e-3)
    return cfg.build()


def init_weights(moe, rank: int, world: int, seed: int) -> None:
    """Every parameter from a generator seeded by (seed, name); the experts' by their global index, so rank r
    holds experts [r E / W, (r + 1) E / W) of one global set."""
    for name, p in moe.named_parameters():
        g = torch.Generator().manual_seed(seed * 7919 + sum(map(ord, name)))
        with torch.no_grad():
            if name.startswith("routed_experts.inner_experts."):
                local = p.shape[0]
                full = torch.randn(local * world, *p.shape[1:], generator=g) / p.shape[-1] ** 0.5
                p.copy_(full[rank * local:(rank + 1) * local])
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)


def relerr(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
    """||a - b|| / ||b|| in float64 (0 when both are zero); inf when only one side has a gradient."""
    if a is None or b is None:
        return 0.0 if a is None and b is None else float("inf")
    a, b = a.double(), b.double()
    den = b.norm()
    return float((a - b).norm() / den) if den > 0 else float((a - b).norm())


def compare(*, dim: int = 64, inter: int = 48, experts_per_rank: int = 4, top_k: int = 3, batch: int = 2,
            seq: int = 5, dtype=torch.float32, device="cpu", seed: int = 0, starve_rank: bool = False,
            starve_expert: bool = False, kernel_backend: str | None = None, grads: bool = True) -> dict:
    """This rank's relative errors, epgen against torchtitan's all-to-all dispatcher (see the module docstring):
    {"out", "x", "router", "w1", "w2", "w3": float}, plus "received_pairs" (pairs this rank's experts got) and
    "empty_experts" (local experts without a pair), for the caller to see that the case it built was exercised."""
    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.distributed.utils import get_spmd_backend, set_spmd_backend
    from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher

    from runtime.integrations.torchtitan import EpgenTokenDispatcher

    rank, world = dist.get_rank(), dist.get_world_size()
    experts = experts_per_rank * world
    device = torch.device(device)
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("ep",))
    shape = dict(dim=dim, inter=inter, experts=experts, top_k=top_k, world=world)
    ref = build_moe(AllToAllTokenDispatcher.Config(num_experts=experts, top_k=top_k), **shape)
    ours = build_moe(EpgenTokenDispatcher.Config(num_experts=experts, top_k=top_k, kernel_backend=kernel_backend),
                     **shape)
    init_weights(ref, rank, world, seed)
    ours.load_state_dict(ref.state_dict())
    bias = torch.zeros(experts)
    if starve_rank:  # the last rank's experts are never chosen: it receives no token
        bias[(world - 1) * experts_per_rank:] = -1e4
    if starve_expert:  # and one expert of rank 0 gets no pair
        bias[1] = -1e4
    assert int((bias == 0).sum()) >= top_k, "the bias leaves fewer experts than top_k"
    for m in (ref, ours):
        m.expert_bias_E.copy_(bias)
        m.to(device=device, dtype=dtype)
        m.routed_experts.token_dispatcher.wire_meshes(ep_mesh=mesh)
    g = torch.Generator().manual_seed(seed * 1_000_003 + rank)
    x0 = torch.randn(batch, seq, dim, generator=g).to(device=device, dtype=dtype)
    grad_out = torch.randn(batch, seq, dim, generator=g).to(device=device, dtype=dtype)

    before = get_spmd_backend()
    results = {}
    try:
        set_spmd_backend("partial_dtensor")  # gloo takes its all_to_all_single; "spmd_types" needs equal chunks
        for name, m in (("ref", ref), ("ours", ours)):
            x = x0.clone().requires_grad_(True)
            out = m(x)
            if grads:
                out.backward(grad_out)
            experts_ = m.routed_experts.inner_experts
            results[name] = {"out": out.detach(), "x": x.grad, "router": m.router.gate.weight.grad,
                             "w1": experts_.w1_EFD.grad, "w2": experts_.w2_EDF.grad, "w3": experts_.w3_EFD.grad}
    finally:
        set_spmd_backend(before)
    errs = {k: relerr(results["ours"][k], results["ref"][k]) for k in results["ref"]}
    with torch.no_grad():  # the routing both ran: pairs per local expert on this rank
        _, ids, _ = ref.router(x0, ref.expert_bias_E)
        every = [torch.empty_like(ids) for _ in range(world)] if world > 1 else [ids]
        if world > 1:
            dist.all_gather(every, ids.contiguous())
        counts = torch.bincount(torch.cat(every).flatten().cpu(), minlength=experts)
        mine = counts[rank * experts_per_rank:(rank + 1) * experts_per_rank]
    errs["received_pairs"] = int(mine.sum())
    errs["empty_experts"] = int((mine == 0).sum())
    op = ours.routed_experts.token_dispatcher.op
    errs["backend"] = op.backend_name if op is not None else None
    return errs


def per_token_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest per-token ||a - b|| / ||b|| over the last dimension (bf16 checks)."""
    a, b = a.double().flatten(0, -2), b.double().flatten(0, -2)
    return float(((a - b).norm(dim=-1) / b.norm(dim=-1).clamp_min(1e-30)).max())


def env_requires_torchtitan() -> bool:
    return os.environ.get(REQUIRE_ENV, "") not in ("", "0")
