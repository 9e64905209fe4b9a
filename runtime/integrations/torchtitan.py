"""torchtitan 0.3.0's MoE token dispatch on epgen: ``EpgenTokenDispatcher`` (docs/TORCHTITAN.md).

A subclass of torchtitan's ``BaseEPTokenDispatcher`` (torchtitan/models/common/token_dispatcher.py) that its MoE
(``RoutedExperts``: dispatch -> ``GroupedExperts`` -> combine) runs unchanged:

* ``init_buffer()`` (torchtitan calls it from ``wire_meshes``) builds an ``EpDispatchCombineOp`` with the grouped
  layout on ``ep_mesh``'s process group: the torch backend on CPU / gloo, the native one on GPUs (the config's
  automatic choice; ``Config.kernel_backend`` or ``EPGEN_KERNEL_BACKEND`` pick one). Its sizes come from the Config
  (``hidden_dim``, ``num_max_tokens_per_rank``, ``dtype``); where one is None the op is built at the first dispatch
  from the tokens (every EP rank dispatches the same token count: torchtitan pads the sequence before routing), and
  built again, on every rank alike, when a later call brings more tokens or another dtype.
* ``dispatch(x_TD, topk_scores_TK, topk_expert_ids_TK, num_local_tokens_per_expert_E)`` ->
  ``(routed_input_RD, num_tokens_per_local_expert_e, metadata)``: each token goes once to every rank holding one of
  its experts, where its (token, local expert) pairs become rows grouped per local expert (epgen's grouped layout:
  ``runtime/grouped.py``), in the order torchtitan's ``AllToAllTokenDispatcher`` gives them (by expert, then
  source rank, token, top-k slot). ``routed_input_RD`` has the layout's P rows (``resolved_grouped_capacity``:
  a fixed bound, no host sync; rows past the groups are never read); ``num_tokens_per_local_expert_e`` (int64) are
  the group sizes, so ``GroupedExperts``' ``cumsum`` gives epgen's group ends (``layout.offs``). With
  ``pad_multiple`` (``expert_alignment``, default 1: no padding, the counts are the real pair counts) each group is
  padded to a multiple of it, as torchtitan's ``TorchAOTokenDispatcher`` pads for fp8 / mxfp8 grouped GEMMs, and
  the counts include the padding (runtime.autograd hands out the rows with the padding zeroed, so the grouped GEMMs'
  weight gradients over it are zero). ``num_local_tokens_per_expert_E`` is not needed (epgen counts on the receive
  side).
* ``combine(routed_output_RD, metadata, x_TD)`` -> ``out_TD``: each pair's output row times its router score in
  float32 (epgen's ``combine_grouped``; torchtitan's reference applies the scores in float32 after its return
  exchange: the same products, summed in another order), summed per token over the ranks.

Gradients reach the tokens, the router scores and the expert outputs through epgen's differentiable legs
(``runtime.autograd``; see ``_legs``). EP degree 1 (no ``ep_mesh``) takes torchtitan's local reorder, as
``AllToAllTokenDispatcher`` does.

Selected in a torchtitan run with its ``@override`` mechanism: ``--override.imports
runtime.integrations.torchtitan.epgen_dispatcher`` replaces every ``AllToAllTokenDispatcher.Config`` of the model
(the ``TorchAOTokenDispatcher`` one too, keeping its ``pad_multiple``); kwargs as JSON:
``'runtime.integrations.torchtitan.epgen_dispatcher={"num_max_tokens_per_rank": 8192}'``. A second override,
``epgen_selective_ac``, makes torchtitan's selective activation checkpointing (``SelectiveAC``) save epgen's ops'
outputs (``EpgenSelectiveAC``), so that its recomputation moves no tokens again.

Every dispatcher of the process with the same EP group and sizes shares one op (``SharedOps``): one workspace for
the model, not one per MoE layer.

This module imports torchtitan (``pip install 'epgen[torchtitan]'``); nothing else in epgen imports it.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import attrs
import torch


def install_torch_shims() -> None:
    """Make torch 2.11 run torchtitan 0.3.0: its dispatchers call ``torch.compiler._is_non_strict_tracing()``,
    which torch 2.11 lacks (newer torch has it). Where it is missing it is set to a function returning False (not
    tracing: eager, what a training step runs), before torchtitan is imported. A no-op on a torch that has it."""
    if not hasattr(torch.compiler, "_is_non_strict_tracing"):
        torch.compiler._is_non_strict_tracing = lambda: False


install_torch_shims()

from torchtitan.config import derive, override  # noqa: E402  (after the shim)
from torchtitan.distributed.activation_checkpoint import SelectiveAC  # noqa: E402
from torchtitan.models.common.token_dispatcher import (  # noqa: E402
    AllToAllTokenDispatcher,
    BaseEPTokenDispatcher,
    LocalTokenDispatcher,
)

from .. import EpDispatchCombineConfig, EpDispatchCombineOp, autograd  # noqa: E402
from ..errors import ConfigError  # noqa: E402
from ..grouped import grouped_rows  # noqa: E402  (the default rows; scripts/train_layer.py sizes its op so too)


@dataclass(frozen=True, kw_only=True)
class EpgenDispatchMetadata:
    """What ``EpgenTokenDispatcher.dispatch`` hands to its ``combine``: the op, the dispatch's routing handle and
    its grouped layout."""

    op: EpDispatchCombineOp
    handle: object
    layout: object


class EpgenTokenDispatcher(BaseEPTokenDispatcher):
    """torchtitan token dispatcher on epgen's grouped layout (see the module docstring)."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseEPTokenDispatcher.Config):
        """hidden_dim, num_max_tokens_per_rank, dtype: the op's sizes (None: from the first dispatch's tokens).
        pad_multiple: rows each local expert's group is padded to a multiple of (epgen's expert_alignment; None:
        1, no padding). grouped_capacity: rows of the grouped layout (0: every local pair of top-k routing,
        ``grouped_rows``; a smaller one drops the last experts' last pairs and counts them in the layout's
        ``dropped``). kernel_backend: "torch", "native" or None (the config's automatic choice). gpu_per_node: the
        EP group's ranks per node (0: all on one node), for an EP group that spans nodes (docs/INTERNODE.md)."""

        hidden_dim: int | None = None
        num_max_tokens_per_rank: int | None = None
        dtype: torch.dtype | None = None
        pad_multiple: int | None = None
        grouped_capacity: int = 0
        kernel_backend: str | None = None
        gpu_per_node: int = 0

    def __init__(self, config: Config):
        super().__init__(config)
        self.hidden_dim = config.hidden_dim
        self.num_max_tokens_per_rank = config.num_max_tokens_per_rank
        self.dtype = config.dtype
        self.pad_multiple = config.pad_multiple or 1
        self.grouped_capacity = config.grouped_capacity
        self.kernel_backend = config.kernel_backend
        self.gpu_per_node = config.gpu_per_node
        self.op: EpDispatchCombineOp | None = None
        self._release: weakref.finalize | None = None

    # --- the op ----------------------------------------------------------------------------------
    def init_buffer(self) -> None:
        """Build the op now when the Config gives its sizes (else at the first dispatch)."""
        if self.ep_mesh is None:
            return
        if None not in (self.hidden_dim, self.num_max_tokens_per_rank, self.dtype):
            self._build(self.hidden_dim, self.num_max_tokens_per_rank, self.dtype)

    def op_config(self, hidden: int, tokens: int, dtype: torch.dtype) -> EpDispatchCombineConfig:
        """The op's config for the EP group, tokens per rank, hidden size and dtype."""
        group = self.ep_mesh.get_group()
        world = group.size()
        if self.num_experts % world:
            raise ValueError(f"EpgenTokenDispatcher: {self.num_experts} experts do not split evenly over the "
                             f"{world} ranks of the EP group")
        per_rank = self.num_experts // world
        cfg = EpDispatchCombineConfig(
            rank=group.rank(), world_size=world, hidden_dim=hidden, max_num_inp_token_per_rank=tokens,
            num_experts_per_rank=per_rank, num_experts_per_token=self.top_k, data_type=dtype,
            kernel_backend=self.kernel_backend, gpu_per_node=self.gpu_per_node, enable_grouped_layout=True,
            expert_alignment=self.pad_multiple)
        rows = self.grouped_capacity or min(cfg.worst_case_grouped_rows,
                                            grouped_rows(world, tokens, per_rank, self.top_k, self.pad_multiple))
        return attrs.evolve(cfg, grouped_capacity=rows)

    def _build(self, hidden: int, tokens: int, dtype: torch.dtype) -> EpDispatchCombineOp:
        group = self.ep_mesh.get_group()
        op = _shared.acquire(self.op_config(hidden, tokens, dtype), group)
        if self._release is not None:
            self._release()  # the old op, closed when no other dispatcher uses it
        self._release = weakref.finalize(self, _shared.release, op)  # also when this dispatcher is collected
        self._release.atexit = False  # not at interpreter exit: the process group may be gone by then
        self.op = op
        self.hidden_dim, self.num_max_tokens_per_rank, self.dtype = hidden, tokens, dtype
        return op

    def op_for(self, x_TD: torch.Tensor) -> EpDispatchCombineOp:
        """The op for these tokens: built (collective, every rank alike: they dispatch the same token count) on
        the first call, or again when the tokens outgrow it or change dtype or width."""
        tokens, hidden = x_TD.shape
        cfg = None if self.op is None else self.op.config
        if (cfg is None or tokens > cfg.max_num_inp_token_per_rank or hidden != cfg.hidden_dim
                or x_TD.dtype != cfg.data_type):
            if torch.compiler.is_compiling():  # building an op is collective host work, no part of a graph
                raise ConfigError(
                    f"EpgenTokenDispatcher under torch.compile needs its op built before tracing, for {tokens} "
                    f"tokens of width {hidden} in {x_TD.dtype} (it has "
                    f"{'none' if cfg is None else f'one for {cfg.max_num_inp_token_per_rank} x {cfg.hidden_dim} in {cfg.data_type}'}"
                    f"): give its Config hidden_dim, num_max_tokens_per_rank (at least the tokens a rank dispatches) "
                    f"and dtype, so that init_buffer() builds it")
            return self._build(hidden, max(tokens, self.num_max_tokens_per_rank or 0), x_TD.dtype)
        return self.op

    # --- dispatch / combine ------------------------------------------------------------------------
    def dispatch(self, x_TD, topk_scores_TK, topk_expert_ids_TK, num_local_tokens_per_expert_E):
        """-> (routed_input_RD [P, D], num_tokens_per_local_expert_e int64 [E / EP], EpgenDispatchMetadata)."""
        if self.ep_mesh is None:  # EP degree 1: the local reorder, as AllToAllTokenDispatcher does
            return LocalTokenDispatcher.dispatch(self, x_TD, topk_scores_TK, topk_expert_ids_TK,
                                                 num_local_tokens_per_expert_E)
        del num_local_tokens_per_expert_E  # epgen counts the pairs on the receiving ranks
        op = self.op_for(x_TD)
        x = x_TD.contiguous()
        scores = topk_scores_TK.to(torch.float32).contiguous()
        ids = topk_expert_ids_TK.to(torch.int32).contiguous()
        rows, layout, handle = _legs.dispatch(op, x, scores, ids)
        offs = layout.offs.to(torch.int64)
        counts = torch.diff(offs, prepend=offs.new_zeros(1))  # group sizes: GroupedExperts' cumsum gives offs
        return rows, counts, EpgenDispatchMetadata(op=op, handle=handle, layout=layout)

    def combine(self, routed_output_RD, metadata, x_TD):
        """-> out_TD: sum over each token's pairs of score * expert output (float32 products and sums)."""
        if self.ep_mesh is None:
            return LocalTokenDispatcher.combine(self, routed_output_RD, metadata, x_TD)
        y = routed_output_RD.to(metadata.op.config.combine_dtype).contiguous()
        return _legs.combine(metadata.op, y, metadata.handle, metadata.layout).to(x_TD.dtype)


class SharedOps:
    """One op per (process group, config) for every dispatcher of the process: a model's MoE layers share one
    workspace (as torchtitan's DeepEP dispatchers share one buffer) instead of one per layer. A later layer's
    forward reuses the op before an earlier layer's backward: the legs keep what their backward needs
    (runtime/autograd.py). An op no dispatcher uses any more is closed (every rank alike: they build and rebuild
    in the same order)."""

    def __init__(self):
        self.ops: dict[tuple, list] = {}  # key -> [op, users]

    @staticmethod
    def key(cfg: EpDispatchCombineConfig, group) -> tuple:
        return (getattr(group, "group_name", None) or id(group), cfg.key)

    def acquire(self, cfg: EpDispatchCombineConfig, group) -> EpDispatchCombineOp:
        entry = self.ops.get(self.key(cfg, group))
        if entry is None or entry[0].closed:
            entry = self.ops[self.key(cfg, group)] = [EpDispatchCombineOp(cfg, group), 0]
        entry[1] += 1
        return entry[0]

    def release(self, op: EpDispatchCombineOp) -> None:
        for key, entry in list(self.ops.items()):
            if entry[0] is op:
                entry[1] -= 1
                if entry[1] <= 0:
                    del self.ops[key]
                    op.close()


_shared = SharedOps()


class _Legs:
    """The two legs: runtime.autograd's dispatch_grouped / combine_grouped (the custom ops epgen::dispatch_grouped /
    epgen::combine_grouped with their backwards when autograd is on; the op's own calls under torch.no_grad()).
    With autograd on the layout's rows are fresh tensors (not the op's buffers), so a later layer's forward on the
    shared op leaves the rows an earlier layer's backward needs alone."""

    @staticmethod
    def dispatch(op, x, scores, ids):
        layout, handle = autograd.dispatch_grouped(op, x, scores, ids)
        return layout.x, layout, handle

    @staticmethod
    def combine(op, y, handle, layout):
        return autograd.combine_grouped(op, y, handle)


_legs = _Legs()


@override(target=AllToAllTokenDispatcher.Config,
          description="epgen expert-parallel dispatch / combine (EpgenTokenDispatcher)")
def epgen_dispatcher(cfg: AllToAllTokenDispatcher.Config, *, num_max_tokens_per_rank: int | None = None,
                     hidden_dim: int | None = None, dtype: str | None = None, pad_multiple: int | None = None,
                     grouped_capacity: int = 0, kernel_backend: str | None = None,
                     gpu_per_node: int = 0) -> EpgenTokenDispatcher.Config:
    """torchtitan override: every ``AllToAllTokenDispatcher.Config`` of the model (``TorchAOTokenDispatcher``'s
    too, whose ``pad_multiple`` is kept unless given) becomes an ``EpgenTokenDispatcher.Config``; the kwargs are
    its fields (``--override.imports 'runtime.integrations.torchtitan.epgen_dispatcher={"kernel_backend":
    "torch"}'``), ``dtype`` by its torch name ("bfloat16", "float32": JSON has no dtypes)."""
    if dtype is not None:
        dtype_ = getattr(torch, dtype, None)
        if not isinstance(dtype_, torch.dtype):
            raise ValueError(f"epgen_dispatcher: dtype={dtype!r} is not a torch dtype name (e.g. \"bfloat16\")")
        dtype = dtype_
    if pad_multiple is None:
        pad_multiple = getattr(cfg, "pad_multiple", None)
    return EpgenTokenDispatcher.Config(num_experts=cfg.num_experts, top_k=cfg.top_k, hidden_dim=hidden_dim,
                                       num_max_tokens_per_rank=num_max_tokens_per_rank, dtype=dtype,
                                       pad_multiple=pad_multiple,
                                       grouped_capacity=grouped_capacity, kernel_backend=kernel_backend,
                                       gpu_per_node=gpu_per_node)


def epgen_save_ops() -> set:
    """epgen's custom ops (runtime.autograd.OP_NAMES: epgen::dispatch_grouped, combine_grouped, dispatch, combine) as
    the op overloads a selective activation checkpointing policy matches."""
    out = set()
    for name in autograd.OP_NAMES:
        namespace, _, op = name.partition("::")
        out.add(getattr(getattr(torch.ops, namespace), op).default)
    return out


class EpgenSelectiveAC(SelectiveAC):
    """torchtitan's per-op selective activation checkpointing that also saves epgen's dispatch and combine outputs
    (as it saves all_to_all_single's and DeepEP's): the recomputation in the backward then moves no tokens again."""

    @dataclass(kw_only=True, slots=True)
    class Config(SelectiveAC.Config):
        pass

    def get_save_ops(self) -> set:
        return super().get_save_ops() | epgen_save_ops()


@override(target=SelectiveAC.Config, exact=True,
          description="selective activation checkpointing that saves epgen's dispatch / combine outputs")
def epgen_selective_ac(cfg: SelectiveAC.Config) -> EpgenSelectiveAC.Config:
    """torchtitan override: its SelectiveAC config (its MoE configs' default) becomes EpgenSelectiveAC's, the same
    fields (``--override.imports runtime.integrations.torchtitan.epgen_selective_ac``)."""
    return derive(cfg, EpgenSelectiveAC.Config)
