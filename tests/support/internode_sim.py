"""A CPU stand-in for the native internode backend's device side, to test its host orchestration.

``SimBackend`` is ``runtime.backends.internode.NativeInternodeBackend`` with its kernels replaced by the Python
functions below (written from the kernel templates' contracts, byte for byte on the same record
layout and buffers) and its collectives by an in-process exchange between threads, one thread per
rank. Everything else -- ordered slots, exchange splits, the v2 stages and the regrouping of return
cells, buffer reuse across calls -- is the backend's own code. Buffers start as random bytes, so a
cell that is read without having been written shows up as a wrong result.
"""

from __future__ import annotations

import threading

import torch

from runtime.backends.internode import NativeInternodeBackend


class SimWorld:
    """Collectives between the threads of one simulated group."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.barrier = threading.Barrier(world_size, timeout=30)
        self.box: dict[int, object] = {}

    def exchange(self, rank: int, value):
        """All-gather: every rank's value, in rank order."""
        self.barrier.wait()
        self.box[rank] = value
        self.barrier.wait()
        out = [self.box[r] for r in range(self.world_size)]
        self.barrier.wait()
        return out


def _i32(buf: torch.Tensor, off: int, n: int = 1) -> torch.Tensor:
    return buf[off: off + 4 * n].view(torch.int32)


def _f32(buf: torch.Tensor, off: int, n: int) -> torch.Tensor:
    return buf[off: off + 4 * n].view(torch.float32)


def _rows(t: torch.Tensor | None, n: int) -> torch.Tensor | None:
    return None if t is None else t.contiguous().view(torch.uint8).reshape(n, -1)


def k_pack(route, x, scales, weights, indices, slots, cells, T, k, W, G, groups, row_bytes, scale_bytes, has_w,
           rec, off_w, off_ids, off_rows, off_src, rank, max_tokens):
    xb, sb = _rows(x, T), _rows(scales, T)
    for grp in range(groups):
        for t in range(T):
            cell = cells[(grp * T + t) * rec: (grp * T + t + 1) * rec]
            rows = []
            for g in range(G):
                dst = grp * G + g if route == "v2" else (grp if grp % G == g else -1)
                row = -1
                for j in range(k):
                    s = int(slots[t, j])
                    if dst >= 0 and s >= 0 and s % W == dst:
                        row = s // W
                rows.append(row)
            _i32(cell, off_rows, G).copy_(torch.tensor(rows, dtype=torch.int32))
            if max(rows) < 0:
                continue
            cell[:row_bytes] = xb[t]
            if scale_bytes:
                cell[row_bytes: row_bytes + scale_bytes] = sb[t]
            _f32(cell, off_w, k).copy_(weights[t] if has_w else torch.zeros(k))
            _i32(cell, off_ids, k).copy_(indices[t])
            _i32(cell, off_src).fill_(rank * max_tokens + t)


def k_forward(route, cells_in, cells_out, ncells, G, rec, off_rows):
    for g in range(G):
        for c in range(ncells):
            src = cells_in[c * rec: (c + 1) * rec]
            dst = cells_out[(g * ncells + c) * rec: (g * ncells + c + 1) * rec]
            if int(_i32(src, off_rows + 4 * g)) >= 0:
                dst.copy_(src)
            else:
                _i32(dst, off_rows + 4 * g).fill_(-1)


def k_unpack(route, cells, ncells, recv_x, recv_scales, recv_w, recv_idx, recv_src, loc, k, row_bytes, scale_bytes,
             rec, off_w, off_ids, off_rows, off_src):
    xb = recv_x.view(torch.uint8).reshape(recv_x.shape[0], -1)
    sb = None if recv_scales is None else recv_scales.view(torch.uint8).reshape(recv_scales.shape[0], -1)
    for c in range(ncells):
        cell = cells[c * rec: (c + 1) * rec]
        row = int(_i32(cell, off_rows + 4 * loc))
        if row < 0:
            continue
        xb[row] = cell[:row_bytes]
        if scale_bytes:
            sb[row] = cell[row_bytes: row_bytes + scale_bytes]
        recv_w[row] = _f32(cell, off_w, k)
        recv_idx[row] = _i32(cell, off_ids, k)
        recv_src[row] = _i32(cell, off_src)[0]


def k_cpack(route, cells, ncells, expert_out, expert_w, has_w, expert_rows, back, loc, k, rec, off_rows, row_bytes,
            brec):
    eb = expert_out.contiguous().view(torch.uint8).reshape(expert_out.shape[0], -1)
    for c in range(ncells):
        row = int(_i32(cells[c * rec: (c + 1) * rec], off_rows + 4 * loc))
        if row < 0:
            continue
        out = back[c * brec: (c + 1) * brec]
        out[:row_bytes] = eb[row] if row < expert_rows else 0
        _f32(out, row_bytes, k).copy_(expert_w[row] if has_w and row < expert_rows else torch.zeros(k))


def k_reduce(route, back, slots, T, k, W, out, out_w, has_w, row_bytes, brec):
    for t in range(T):
        acc = torch.zeros(out.shape[1], dtype=torch.float32)
        wacc = torch.zeros(k, dtype=torch.float32)
        for j in range(k):
            s = int(slots[t, j])
            if s < 0:
                continue
            cell = back[((s % W) * T + t) * brec: ((s % W) * T + t + 1) * brec]
            acc += cell[:row_bytes].view(out.dtype).float()
            wacc += _f32(cell, row_bytes, k)
        out[t] = acc.to(out.dtype)
        if has_w:
            out_w[t] = wacc


KERNELS = {"pack": k_pack, "forward": k_forward, "unpack": k_unpack, "cpack": k_cpack, "reduce": k_reduce}
FAMILIES = {"pack": "internode_pack", "forward": "internode_forward", "unpack": "internode_unpack",
            "cpack": "internode_combine_pack", "reduce": "internode_reduce"}


def declared_order(role: str, args: dict) -> list:
    """The backend's named arguments in the family's declared order (specs/kernels.toml [args.NAME]): exactly the
    declared names, as the real launch (runtime.kernels.Kernel) requires."""
    from runtime.config import load_specs

    specs = load_specs()
    names = [f.name for f in specs.arglists[specs.families[FAMILIES[role]].args].fields]
    assert sorted(args) == sorted(names), (role, sorted(set(args) ^ set(names)))
    return [args[n] for n in names]


class SimBackend(NativeInternodeBackend):
    """The native internode backend's host code on CPU, with the kernels and collectives above."""

    def __init__(self, config, world: SimWorld, seed: int = 0):  # noqa: D107 - no GPU, no process group
        self.config, self.world = config, world
        self.device = torch.device("cpu")
        self.arch, self.num_sms, self.kern, self.group = "sim", 1, {}, None
        self.check_ids = True
        self._numbering = None  # the torch reference numbering (routing.ordered_slots) on CPU
        self._setup_buffers(self.device)
        g = torch.Generator().manual_seed(seed)
        for buf in (self.send, self.recv, self.mid, self.back_a, self.back_b):
            if buf is not None:  # garbage, as fresh device memory may hold
                buf.copy_(torch.randint(0, 256, buf.shape, generator=g, dtype=torch.uint8))

    def _launch(self, route, role, items, threads=0, **args):
        if items > 0:
            KERNELS[role](route, *declared_order(role, args))

    def _gather_pairs(self, mine):
        return [[int(v) for v in pair] for pair in self.world.exchange(self.config.rank, mine.clone())]

    def _gather_counts(self, cnt):
        return torch.stack(self.world.exchange(self.config.rank, cnt.clone()))

    def _a2a(self, out, inp, out_cells, in_cells, size):
        chunks, off = [], 0
        for n in in_cells:
            chunks.append(inp[off * size: (off + n) * size].clone())
            off += n
        got = self.world.exchange(self.config.rank, chunks)
        off = 0
        for src, n in enumerate(out_cells):
            piece = got[src][self.config.rank]
            assert piece.numel() == n * size, (f"rank {self.config.rank} expects {n} cells from {src}, "
                                               f"which sends {piece.numel() // size}")
            out[off * size: (off + n) * size] = piece
            off += n


def run_ranks(world: SimWorld, fn) -> list:
    """fn(rank) on one thread per rank; returns the results; re-raises the first failure (and breaks
    the barrier, so the other ranks stop waiting)."""
    world_size = world.world_size
    results, errors = [None] * world_size, []

    def body(r):
        try:
            results[r] = fn(r)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append((r, e))
            world.barrier.abort()

    threads = [threading.Thread(target=body, args=(r,)) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        real = [e for e in errors if not isinstance(e[1], threading.BrokenBarrierError)]
        raise (real or errors)[0][1]
    return results
