"""The kernel plan: one place that turns a config and a GPU target into kernels and buffers.

Plan.of(config, target) decides, from the config and the target alone (so every rank decides alike, and
a CPU process can ask too): the intranode protocol, every kernel variant the op can launch (`roles`:
role -> variant name), the row sizes, and the table of every buffer (`regions`: the symmetric workspace,
in order, and the op's other device buffers). The native backend allocates from that table, the memory
report and the workspace formula (runtime.op.native_workspace) read the same one, and plan.load() loads
every kernel in one loop into a KernelSet that launches them by role with their declared arguments
(specs/kernels.toml [args.NAME]; runtime/kernels.py Kernel). Backends ask the plan; they never spell
a variant name.

Symmetric workspace per rank (each region 256-byte aligned; R = max_recv_tokens, T = max tokens per
rank, W = world, P = grouped rows):
  signal [W] i32 | counter [2 + 2W] i32 (claims, arrivals) | low latency (when the op may take it):
  ll_cnt, ll_x, ll_c, ll_map (runtime/ll.py) | recv_x [R, wire row] | recv_scales [R, scale row] |
  recv_w [R, k] f32 | recv_idx [R, k] i32 | recv_src [R] i32 | gather: comb_x [R, H] comb_w [R, k] |
  scatter: scat_x [T*W, wire row] scat_s [T*W, scale row] scat_w [T*W, k]
With max_inflight = N > 1 that whole list is laid out N times, one workspace slot per operation in flight
(slot s > 0's regions are named NAME@s), then the local buffers N times likewise: slot_layout() gives one
slot's offsets by the plain names.
"""

from __future__ import annotations

import attrs
import torch

from . import kernels, ll
from .config import EpDispatchCombineConfig, load_specs, spec_dtype
from .errors import InputError

REGION_ALIGN = 256
_SCALE_BYTES = {"none": 0, "fp32": 4, "e8m0": 1}
WORKSPACE, LOCAL = "workspace", "local"  # where a region lives: the peer-mapped workspace, or this rank only
SLOT_SEP = "@"  # region NAME of workspace slot s > 0 is NAME@s (max_inflight)


def slot_name(name: str, slot: int) -> str:
    """The region name of `name` in workspace slot `slot` (slot 0 keeps the plain name)."""
    return name if slot == 0 else f"{name}{SLOT_SEP}{slot}"


def align(n: int) -> int:
    return -(-n // REGION_ALIGN) * REGION_ALIGN


def _elem_bits(dtype: torch.dtype) -> int:
    """Bits per value (float4_e2m1fn_x2 packs two 4-bit values in each 1-byte element)."""
    return 4 if dtype == torch.float4_e2m1fn_x2 else torch.empty((), dtype=dtype).element_size() * 8


DIRECT_MAX_GRID = 1024  # the direct kernel's blocks at most (NativeBackend._dispatch_site)
DIRECT_MAX_TOKENS = 1 << 21  # tokens a rank at most: tokens x blocks < 2^32


def direct_grouped(cfg: EpDispatchCombineConfig, act: str, capped: bool) -> bool:
    """Can this op's bandwidth dispatch_grouped run as one direct kernel (templates/kernels/dispatch_direct.j2: the
    rows stored straight into the destinations' groups)? Intranode, the grouped layout without decoding, bf16 / fp32
    rows moved as they are (no quantization, no scales), no receive cap (every row fits), top-k within a wave, and
    the per-(rank, expert) counters within the kernel's shared memory, and at most DIRECT_MAX_TOKENS tokens a rank
    (the kernel splits them over its DIRECT_MAX_GRID blocks at most in 32-bit arithmetic). Such an op keeps its
    grouped rows, their pair ids / experts / weights, its pair map and a count table in the symmetric workspace (its
    peers write them)."""
    W, E, k = cfg.world_size, cfg.num_experts_per_rank, cfg.num_experts_per_token
    buckets = dict(load_specs().arglists["ep"].limits)["direct_buckets"]
    return (cfg.enable_grouped_layout and not cfg.is_internode and not cfg.grouped_dequantize
            and cfg.dispatch_data_type is None and cfg.dispatch_quant_type == "none" and act in ("bf16", "fp32")
            and not capped and k <= 32 and W <= 64 and W * E + W <= buckets
            and cfg.max_num_inp_token_per_rank <= DIRECT_MAX_TOKENS)


# the most ranks at which dispatch_grouped takes the direct kernel by default (mode "auto"): measured at one rank;
# past two its time is not yet measured (its count tables are read in one pass since 6f7102f, correct at 4 and 8
# ranks sharing one GPU; docs/PERF.md)
DIRECT_AUTO_MAX_WORLD = 2
DIRECT_MODES = ("auto", "always", "never")


def direct_call(mode: str, allowed: bool, protocol: str, fresh: bool, replay: bool, world: int) -> bool:
    """Does one dispatch_grouped call take the direct kernel? Only where the op allows it (Plan.direct:
    direct_grouped above), on a bandwidth-protocol call into the op's own layout (not fresh) that is no routing
    replay; then by mode (NativeBackend.direct): "always" takes it, "never" does not, "auto" at world sizes up to
    DIRECT_AUTO_MAX_WORLD. Another mode is an InputError."""
    if mode not in DIRECT_MODES:
        raise InputError(f"direct dispatch mode must be one of {', '.join(DIRECT_MODES)}, got {mode!r}")
    if mode == "never" or not allowed or protocol != "bw" or fresh or replay:
        return False
    return mode == "always" or world <= DIRECT_AUTO_MAX_WORLD


@attrs.frozen
class Region:
    name: str
    nbytes: int  # before alignment
    where: str   # WORKSPACE or LOCAL


@attrs.frozen
class Plan:
    """What an op moves and launches, derived from its config and its target: protocol, variants, row
    sizes, buffers."""
    target: str
    protocol: str          # the op's intranode protocol, "bw" or "ll" (runtime/ll.py resolve)
    ll_tokens: int         # tokens per rank the low-latency buffers hold (0: none)
    capped: bool           # max_recv_tokens below the worst case: dispatch numbers its slots first
    roles: tuple[tuple[str, str], ...]  # (role, variant name) of every kernel the op can launch
    in_row: int            # bytes of one x row given to dispatch
    wire_row: int          # bytes of one received row
    scale_row: int         # bytes of one received row's scales
    out_dtype: torch.dtype  # dtype of the received rows as returned
    out_cols: int
    scales_dtype: torch.dtype | None
    scale_cols: int
    comb_row: int          # bytes of one combine-dtype row
    scat_row: int          # bytes of one row on the scatter wire
    scat_scale_row: int
    scatter: bool
    fp8_dtype: torch.dtype
    ll_row: int            # bytes of one low-latency dispatch slot (runtime/ll.py)
    ll_cell: int           # bytes of one low-latency combine cell
    grouped_row: int       # bytes of one grouped-layout row (decoded rows with grouped_dequantize)
    grouped_scale_row: int
    direct: bool = False   # dispatch_grouped may take the direct kernel (direct_grouped): grouped buffers in the workspace

    @classmethod
    def of(cls, cfg: EpDispatchCombineConfig, target) -> "Plan":
        specs = load_specs()
        H, k = cfg.hidden_dim, cfg.num_experts_per_token
        fp8 = "fp8_e4m3fn" if target.fp8_e4m3 == "ocp" else "fp8_e4m3fnuz"
        wire_of = {"fp8": fp8, "fp4": "fp4_e2m1"}
        act = spec_dtype(cfg.data_type).name
        comb = spec_dtype(cfg.combine_dtype).name
        comb_row = H * _elem_bits(cfg.combine_dtype) // 8
        scales_dtype, scale_cols = None, 0
        place = "grouped_place.i32"
        if cfg.dispatch_data_type is not None:  # pre-quantized payload: bytes and scales verbatim
            payload = cfg.dispatch_data_type
            d_name = f"dispatch.{spec_dtype(payload).name}.intranode"
            in_row = wire_row = H * _elem_bits(payload) // 8
            scale_row = cfg.scale_dim * cfg.scale_type_size
            out_dtype, out_cols = payload, (H // 2 if payload == torch.float4_e2m1fn_x2 else H)
            scales_dtype = torch.float32 if cfg.scale_type_size == 4 else torch.uint8
            scale_cols = cfg.scale_dim
        elif cfg.dispatch_quant_type != "none":  # bf16/fp32 in, quantized on the way
            q = specs.quants[cfg.dispatch_quant_type]
            wire = specs.dtypes[wire_of[q.wire_kind]]
            d_name = f"dispatch.{act}.{wire.name}.{q.name}.intranode"
            if cfg.grouped_dequantize:
                place = f"grouped_place_{wire.kind}.{act}.{wire.name}.{q.name}"
            in_row = H * _elem_bits(cfg.data_type) // 8
            wire_row = H * wire.bits // 8
            scale_cols = H // q.block
            scale_row = scale_cols * _SCALE_BYTES[q.scale]
            out_dtype = getattr(torch, wire.torch) if wire.kind == "fp8" else torch.uint8
            out_cols = H if wire.kind == "fp8" else H // 2
            scales_dtype = torch.float32 if q.scale == "fp32" else torch.uint8
        else:
            d_name = f"dispatch.{act}.intranode"
            in_row = wire_row = H * _elem_bits(cfg.data_type) // 8
            scale_row, out_dtype, out_cols = 0, cfg.data_type, H
        scatter = cfg.resolved_combine_mode == "scatter"
        scat_row, scat_scale_row = comb_row, 0
        if not scatter:
            c_name = f"combine_gather.{comb}.intranode"
        elif cfg.quant_type == "none":
            c_name = f"combine_scatter.{comb}.intranode"
        else:
            q = specs.quants[cfg.quant_type]
            wire = specs.dtypes[wire_of[q.wire_kind]]
            c_name = f"combine_scatter.{comb}.{wire.name}.{q.name}.intranode"
            scat_row = H * wire.bits // 8
            scat_scale_row = (H // q.block) * _SCALE_BYTES[q.scale] if q.block else 0
        protocol = ll.resolve(cfg.intranode_protocol, "ll" in cfg.intranode_protocols,
                              cfg.max_num_inp_token_per_rank, specs.ll_max_tokens.get(target.name, 0))
        ll_tokens = ll.buffer_tokens(protocol, cfg.max_num_inp_token_per_rank)
        capped = cfg.max_recv_tokens < cfg.world_size * cfg.max_num_inp_token_per_rank
        roles = [("dispatch", d_name), ("combine", c_name)]
        if ll_tokens:  # the low-latency kernels moving the same rows (a verbatim payload, the gather's arithmetic)
            roles += [("dispatch_ll", "dispatch_ll." + d_name.split(".", 1)[1]),
                      ("combine_ll", "combine_ll." + c_name.split(".", 1)[1])]
            if cfg.enable_grouped_layout:  # the eager dispatch_grouped's one launch: dispatch_ll with its placing tail
                roles.append(("dispatch_ll_tail", "dispatch_ll_tail." + d_name.split(".", 1)[1]))
        if capped:  # the deterministic slot numbering (routing.ordered_slots)
            roles += [("route_count", "route_count.i32"), ("route_slots", "route_slots.i32")]
        if cfg.enable_std_moe:
            roles += [("std_moe_pack", f"std_moe_pack.{act}"), ("std_moe_unpack", f"std_moe_unpack.{act}")]
        dequantized = cfg.grouped_dequantize and cfg.dispatch_quant_type != "none"
        if cfg.enable_grouped_layout:
            roles += [("grouped_count", "grouped_count.i32"), ("grouped_place", place),
                      ("grouped_reduce", f"grouped_reduce.{comb}"), ("grouped_scale", f"grouped_scale.{comb}")]
        direct = direct_grouped(cfg, act, capped)
        if direct:
            roles.append(("dispatch_direct", f"dispatch_direct.{act}.intranode"))
        return cls(target=target.name, protocol=protocol, ll_tokens=ll_tokens, capped=capped, roles=tuple(roles),
                   in_row=in_row, wire_row=wire_row, scale_row=scale_row, out_dtype=out_dtype, out_cols=out_cols,
                   scales_dtype=scales_dtype, scale_cols=scale_cols, comb_row=comb_row, scat_row=scat_row,
                   scat_scale_row=scat_scale_row, scatter=scatter, fp8_dtype=getattr(torch, specs.dtypes[fp8].torch),
                   ll_row=ll.row_bytes(in_row, scale_row, k), ll_cell=ll.cell_bytes(comb_row, k),
                   grouped_row=in_row if dequantized else wire_row,
                   grouped_scale_row=0 if dequantized or scales_dtype is None else scale_row, direct=direct)

    # --- the kernels ------------------------------------------------------------------------------
    def variant(self, role: str) -> str:
        """The variant name of `role` (KeyError: this op never launches it)."""
        return dict(self.roles)[role]

    @property
    def dispatch_variant(self) -> str:
        return self.variant("dispatch")

    @property
    def combine_variant(self) -> str:
        return self.variant("combine")

    @property
    def place_variant(self) -> str:
        return self.variant("grouped_place")

    @property
    def ll_variants(self) -> tuple[str, str]:
        """The low-latency kernels moving the same rows (whether or not this op loads them)."""
        return ("dispatch_ll." + self.dispatch_variant.split(".", 1)[1],
                "combine_ll." + self.combine_variant.split(".", 1)[1])

    def load(self, arch: str | None = None) -> "KernelSet":
        """Every kernel of `roles`, selected for `arch` (default: the plan's target) and loaded, in one loop."""
        return KernelSet(arch or self.target, self.roles)

    # --- the buffers ------------------------------------------------------------------------------
    def regions(self, cfg: EpDispatchCombineConfig, ll_tokens: int | None = None) -> tuple[Region, ...]:
        """Every buffer the native op allocates from its config: the symmetric workspace's regions of each
        workspace slot (config max_inflight; slot s > 0's named NAME@s) in their order, then the local buffers
        of each slot likewise (docs/RUNTIME.md, Memory)."""
        one = self.slot_regions(cfg, ll_tokens)
        slots = range(cfg.max_inflight)
        return tuple(Region(slot_name(r.name, s), r.nbytes, r.where)
                     for where in (WORKSPACE, LOCAL) for s in slots for r in one if r.where == where)

    def slot_regions(self, cfg: EpDispatchCombineConfig, ll_tokens: int | None = None) -> tuple[Region, ...]:
        """The buffers of one workspace slot: the symmetric workspace's regions in their
        order (the low-latency ones, for calls of at most ll_tokens tokens, default the plan's, lie before
        recv_x: reset() zeroes everything of a slot before its recv_x), then the op's local buffers of the std-MoE
        and grouped layouts (docs/RUNTIME.md, Memory)."""
        R, k, W = cfg.max_recv_tokens, cfg.num_experts_per_token, cfg.world_size
        cells = cfg.max_num_inp_token_per_rank * W
        tokens = self.ll_tokens if ll_tokens is None else ll_tokens
        P, E = cfg.resolved_grouped_capacity, cfg.num_experts_per_rank
        # the direct dispatch's count table (before recv_x: reset() zeroes it with the counters)
        table = [("grouped_cnt", 8 * 2 * W * (E + 1))] if self.direct else []  # tagged 64-bit words, 2 parities
        ws = [("signal", 4 * W), ("counter", 8 + 8 * W), *table, *ll.regions(W, tokens, self.ll_row, self.ll_cell),
              ("recv_x", R * self.wire_row), ("recv_scales", R * self.scale_row), ("recv_w", R * k * 4),
              ("recv_idx", R * k * 4), ("recv_src", R * 4)]
        if self.scatter:
            ws += [("scat_x", cells * self.scat_row), ("scat_s", cells * self.scat_scale_row), ("scat_w", cells * k * 4)]
        else:
            ws += [("comb_x", R * self.comb_row), ("comb_w", R * k * 4)]
        if self.direct:  # the direct dispatch's peers write the grouped rows, their src / m_indices / weights, the pair map
            ws += [("grouped_x", P * self.grouped_row), ("grouped_rows", 12 * P), ("grouped_map", 4 * R * k)]
        local = []
        if cfg.enable_std_moe:
            local.append(("std_moe_x", E * cfg.resolved_expert_capacity * cfg.hidden_dim * self.out_dtype.itemsize))
        if cfg.enable_grouped_layout and self.direct:  # pair_rel per (row, k); offs, counts, raw counts; the drops
            local += [("grouped_scales", 0), ("grouped_meta", 4 * R * k + 12 * E + 4)]
        elif cfg.enable_grouped_layout:
            # src, m_indices, weights per grouped row; pair_rel and pair_pos per (row, k); offs, counts, raw
            # counts per expert; the drop count
            local += [("grouped_x", P * self.grouped_row), ("grouped_scales", P * self.grouped_scale_row),
                      ("grouped_meta", 12 * P + 8 * R * k + 12 * E + 4)]
        return tuple(Region(n, b, WORKSPACE) for n, b in ws) + tuple(Region(n, b, LOCAL) for n, b in local)

    def layout(self, cfg: EpDispatchCombineConfig, ll_tokens: int | None = None) -> dict[str, int]:
        """Byte offsets of every workspace region, and 'total' (the same on every rank)."""
        out, off = {}, 0
        for r in self.regions(cfg, ll_tokens):
            if r.where == WORKSPACE:
                out[r.name] = off
                off += align(r.nbytes)
        out["total"] = off
        return out

    @staticmethod
    def slot_layout(layout: dict[str, int], slot: int) -> dict[str, int]:
        """Workspace slot `slot`'s offsets from layout(), by the plain region names (and the whole 'total')."""
        tail = f"{SLOT_SEP}{slot}"
        if slot == 0:
            return {n: o for n, o in layout.items() if SLOT_SEP not in n}
        return {n[:-len(tail)]: o for n, o in layout.items() if n.endswith(tail)} | {"total": layout["total"]}


NATIVE_WORKSPACE_FORMULA = (
    "per rank, bytes = 12*W + 8 + R*(wire_row + scale_row + 8k + 4) + (gather: R*(H*c + 4k); scatter: "
    "T*W*(scat_row + scat_scale_row + 4k)) + std-MoE E_local*C*H*d + grouped layout P*(wire_row + scale_row) "
    "(with grouped_dequantize: P*H*a, the rows decoded into data_type, a bytes each, no scales) + "
    "(12P + 8Rk + 12E_local + 4) (an op the direct dispatch may serve (direct_grouped) has grouped_x, grouped_rows "
    "12P, grouped_map 4Rk and grouped_cnt 16W(E_local + 1) in the workspace, grouped_meta 4Rk + 12E_local + 4), "
    "every region rounded up to 256 bytes, all of it times max_inflight (one "
    "workspace slot per operation in flight; slot s > 0's regions named NAME@s) "
    "(regions: signal, counter, recv_x, recv_scales, recv_w, recv_idx, recv_src, comb_x, comb_w | scat_x, "
    "scat_s, scat_w; std_moe_x, grouped_x, grouped_scales, grouped_meta outside the symmetric workspace); counter = 2 claim + 2W arrival words; an op that may "
    "take the low-latency protocol adds ll_cnt 16W, ll_x 2*W*L*ll_row, ll_c L*W*ll_cell, ll_map 4*(W*L + W) "
    "(L = its low-latency token limit, ll_row / ll_cell: runtime/ll.py); R = max_recv_tokens, W = world_size, T = max_num_inp_token_per_rank, "
    "H = hidden_dim, k = top-k, c/d = bytes per combine/dispatch element, C = expert capacity, "
    "E_local = num_experts_per_rank, P = grouped rows (grouped_capacity, else the worst case "
    "floor((R*k + E_local*(A - 1)) / A) * A, A = expert_alignment)")
def native_workspace(config: EpDispatchCombineConfig, ll_tokens: int = 0) -> dict:
    """The native workspace formula (docs/RUNTIME.md, Memory) for this config: {"regions": {name: bytes}, "total_bytes",
    "formula"}, read from the kernel plan's buffer table (runtime/plan.py, the one the native backend
    allocates from); each region rounded up to 256 bytes. ll_tokens: the low-latency protocol's token limit
    (0: the op never takes it)."""
    target = next(iter(load_specs().targets.values()))  # sizes are the same on every target
    sized = {r.name: align(r.nbytes) for r in Plan.of(config, target).regions(config, ll_tokens)}
    return {"backend": "native (formula)", "regions": sized, "total_bytes": sum(sized.values()),
            "formula": NATIVE_WORKSPACE_FORMULA}


def internode_roles(cfg: EpDispatchCombineConfig, routes: tuple[str, ...]) -> dict[str, tuple[tuple[str, str], ...]]:
    """The internode kernels of each route ("v2", "v2_ll"): (role, variant name) pairs, and "numbering":
    the slot numbering kernels every route takes (routing.ordered_slots)."""
    payload, comb = spec_dtype(cfg.dispatch_dtype).name, spec_dtype(cfg.combine_dtype).name
    out = {"numbering": (("route_count", "route_count.i32"), ("route_slots", "route_slots.i32"))}
    for route in routes:
        topo = {"v2": "internode_v2", "v2_ll": "internode_v2_ll"}[route]
        roles = [("pack", f"internode_pack.{payload}.{topo}"), ("unpack", f"internode_unpack.{payload}.{topo}"),
                 ("cpack", f"internode_combine_pack.{comb}.{topo}"), ("reduce", f"internode_reduce.{comb}.{topo}")]
        if route == "v2":
            roles.append(("forward", f"internode_forward.{payload}.{topo}"))
        out[route] = tuple(roles)
    return out


class KernelSet:
    """Loaded kernels by role: `ks.launch(role, grid, block, name=value, ...)` (or one struct for the EP
    kernels: `ks.struct(role, **fields)` makes it), `ks[role]`, `role in ks`, `ks.close()`."""

    def __init__(self, arch: str, roles: tuple[tuple[str, str], ...]):
        self._k: dict[str, kernels.Kernel] = {}
        try:
            for role, name in roles:
                self._k[role] = kernels.load(kernels.select(arch, name))
        except BaseException:
            self.close()
            raise

    def __getitem__(self, role: str) -> "kernels.Kernel":
        return self._k[role]

    def __contains__(self, role: str) -> bool:
        return role in self._k

    def items(self):
        return self._k.items()

    def launch(self, role: str, grid: int, block: int, args=None, /, **kw) -> int:
        """Launch `role`'s kernel on torch's current stream (its declared arguments: runtime/kernels.py Kernel)."""
        return self._k[role].launch(grid, block, args, **kw)

    def launch_struct(self, role: str, grid: int, block: int, args, stream: int | None = None) -> int:
        """launch(role, grid, block, args) of an EP kernel's argument block made by struct(role) (not checked again:
        the eager calls' launch, host time), on `stream` (the call's, looked up once) or torch's current one."""
        return self._k[role].raw.launch_params(grid, block, args._epg_params, stream)

    def struct(self, role: str, **fields):
        """A fresh argument struct of `role`'s kernel (its family's struct list), fields set by name, with the
        driver's argument array on it (kernels.struct_params)."""
        s = kernels.struct_type(self._k[role].signature)(**fields)
        kernels.struct_params(s)
        return s

    def symbols(self, *roles: str) -> tuple[str, ...]:
        return tuple(self._k[r].symbol for r in roles or self._k if r in self._k)

    def close(self) -> None:
        for kern in self._k.values():
            kern.close()
        self._k = {}
