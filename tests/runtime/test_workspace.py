"""The symmetric-workspace pool (runtime/workspace.py) and the ordered slot layout under a receive cap
(runtime/routing.ordered_slots), on CPU: 2 gloo ranks with a stand-in allocator, and all ranks of a
routing simulated in one process against the (source rank, token) oracle."""

from __future__ import annotations

import pytest
import torch

from tests.support.ep_dist import get_world
from tests.support.ep_oracle import expected_received, random_routing
from runtime import workspace
from runtime.routing import ordered_slots, send_counts


def scn_pool(rank, world):
    import torch.distributed as dist

    workspace.release_workspaces()
    made = []

    def fake(nbytes, device, group):
        made.append(nbytes)
        return torch.zeros(nbytes, dtype=torch.uint8), object()

    dev, g = torch.device("cpu"), dist.group.WORLD
    a = workspace.acquire(64, dev, g, fake)
    a.buf.fill_(7)
    workspace.release(a)
    b = workspace.acquire(64, dev, g, fake)  # every rank holds the same one: reused, zeroed
    assert b is a and int(b.buf.sum()) == 0 and made == [64]
    c = workspace.acquire(64, dev, g, fake)  # pool empty: fresh, next sequence number
    assert c.seq == a.seq + 1 and made == [64, 64]
    workspace.release(a)
    if rank == 0:  # only rank 0 gives c back: the ranks would take different buffers
        workspace.release(c)
    # rank 0's pool now offers c, rank 1's offers a: they disagree, so every rank allocates afresh
    d = workspace.acquire(64, dev, g, fake)
    assert d is not a and d is not c and len(made) == 3
    seqs = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(seqs, torch.tensor([d.seq]))
    other = workspace.acquire(128, dev, g, fake)  # another size: its own key
    assert other.buf.numel() == 128
    workspace.release(other)
    freed = workspace.release_workspaces()
    return [int(s) for s in seqs], len(made), freed


def test_pool_reuses_only_what_every_rank_holds():
    res = get_world(2).run(scn_pool)
    for seqs, made, freed in res:
        assert seqs[0] == seqs[1], f"ranks use different workspaces: {seqs}"
        assert made == 4 and freed >= 128
    assert res[0][0] == res[1][0]


def _simulate(all_idx, epr, num_experts, cap):
    W = len(all_idx)
    every = torch.stack([send_counts(i, W, epr, num_experts)[2].sum(0) for i in all_idx])
    return [ordered_slots(all_idx[r], r, W, epr, num_experts, cap, lambda counts: every) for r in range(W)]


@pytest.mark.parametrize("world,cap", [(2, 5), (2, 1000), (3, 17), (4, 1)])
def test_ordered_slots_number_rows_in_source_token_order(world, cap):
    epr, k = 3, 4
    E = epr * world
    g = torch.Generator().manual_seed(world * 100 + cap)
    all_idx = [random_routing(g, n, k, E) for n in (9, 0, 13, 7)[:world]]
    all_idx[0][0, 1] = E + 2  # an out-of-range id sends nothing
    res = _simulate(all_idx, epr, E, cap)
    for dst in range(world):
        want = expected_received([torch.where(i >= E, -1, i) for i in all_idx], dst, epr)
        got = {}
        for src, (slots, _, _) in enumerate(res):
            for t, j in (slots % world == dst).nonzero().tolist():
                s = int(slots[t, j])
                if s >= 0:
                    assert s // world not in got, f"two rows in slot {s // world} of rank {dst}"
                    got[s // world] = (src, t)
        kept = min(cap, len(want))
        assert [got[i] for i in range(len(got))] == want[:kept]
        _, total, dropped = res[dst]
        assert int(total) == kept and int(dropped) == len(want) - kept


def test_pool_never_reuses_across_inits(monkeypatch):
    """A workspace made under one default process group is not offered under another."""
    import torch.distributed as dist

    class FakeGroup:
        group_name = "0"

    class World:  # stands in for a default process group (the pool keeps a weak reference to it)
        pass

    old, new = World(), World()
    made = []
    world = {"now": old}
    monkeypatch.setattr(workspace, "current_world", lambda: world["now"])
    monkeypatch.setattr(workspace, "all_gather_single", lambda out, inp, group: out.copy_(inp.expand_as(out)))
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 1)
    fake = lambda n, d, g: (made.append(n) or torch.zeros(n, dtype=torch.uint8), object())  # noqa: E731
    workspace.release_workspaces()
    a = workspace.acquire(32, torch.device("cpu"), FakeGroup(), fake)
    workspace.release(a)
    assert workspace.acquire(32, torch.device("cpu"), FakeGroup(), fake) is a  # same init: reused
    workspace.release(a)
    world["now"] = new  # destroy_process_group + init_process_group
    b = workspace.acquire(32, torch.device("cpu"), FakeGroup(), fake)
    assert b is not a and len(made) == 2 and b.world() is new
    workspace.release_workspaces()


def test_workspace_allocator_from_environment(monkeypatch):
    monkeypatch.delenv(workspace.ALLOCATOR_ENV, raising=False)
    assert workspace.allocator_name() == "ipc"
    monkeypatch.setenv(workspace.ALLOCATOR_ENV, " Symmetric ")
    assert workspace.allocator_name() == "symmetric"
    for bad in ("nvshmem", "ipc;x", "../x"):
        monkeypatch.setenv(workspace.ALLOCATOR_ENV, bad)
        with pytest.raises(workspace.EpgenError, match="must be ipc or symmetric"):
            workspace.default_allocator()


def test_shared_devices_names_ranks_on_one_gpu():
    from runtime.ipc import shared_devices

    assert shared_devices(["a", "b"]) == {}
    assert shared_devices(["a", "b", "a", "c", "b", "a"]) == {"a": [0, 2, 5], "b": [1, 4]}


def scn_host_collectives(rank, world):
    """On a gloo group: all_gather_single and all_to_all_single give every rank the right pieces."""
    import torch.distributed as dist

    g = dist.group.WORLD
    assert not workspace.device_collectives(g)
    every = torch.empty(2 * world, dtype=torch.int64)
    workspace.all_gather_single(every, torch.tensor([rank, 10 * rank]), g)
    assert every.tolist() == [v for r in range(world) for v in (r, 10 * r)]
    send = torch.tensor([100 * rank + d for d in range(world) for _ in range(d + 1)])  # d + 1 values to rank d
    out = torch.empty(world * (rank + 1), dtype=torch.int64)
    workspace.all_to_all_single(out, send, [rank + 1] * world, [d + 1 for d in range(world)], g)
    assert out.tolist() == [100 * s + rank for s in range(world) for _ in range(rank + 1)]


def test_host_collectives_on_gloo():
    get_world(2).run(scn_host_collectives)


class _FakeIpcApi:
    """A stand-in for a vendor IPC module: handles as a struct with `reserved` bytes (hip-python's form)
    or behind getPtr() (cuda-bindings' form); opened handles map to the exporter's pointer + 1."""

    class fakeError_t:
        fakeSuccess = 0
        fakeErrorInvalid = 1

    fakeIpcMemLazyEnablePeerAccess = 1

    def __init__(self, pointer_style: bool):
        import ctypes

        class Handle:
            def __init__(self):
                self._buf = ctypes.create_string_buffer(64)

            if pointer_style:
                def getPtr(self):
                    return ctypes.addressof(self._buf)
            else:
                @property
                def reserved(self):
                    return self._buf.raw

                @reserved.setter
                def reserved(self, raw):
                    self._buf.raw = raw

        self.fakeIpcMemHandle_t = Handle
        self.live = {}
        self.next = 0x1000

    def fakeMalloc(self, n):
        self.next += 0x1000
        self.live[self.next] = n
        return 0, self.next

    def fakeFree(self, ptr):
        return (0,) if self.live.pop(ptr, None) is not None else (self.fakeError_t.fakeErrorInvalid,)

    def fakeIpcGetMemHandle(self, ptr):
        h = self.fakeIpcMemHandle_t()
        raw = ptr.to_bytes(8, "little") + bytes(56)
        if hasattr(h, "getPtr"):
            import ctypes
            ctypes.memmove(h.getPtr(), raw, 64)
        else:
            h.reserved = raw
        return 0, h

    def fakeIpcOpenMemHandle(self, h, flags):
        import ctypes
        raw = ctypes.string_at(h.getPtr(), 64) if hasattr(h, "getPtr") else h.reserved
        assert flags == 1
        return 0, int.from_bytes(raw[:8], "little") + 1

    def fakeIpcCloseMemHandle(self, ptr):
        return (0,)


@pytest.mark.parametrize("pointer_style", [True, False], ids=["getPtr", "reserved"])
def test_ipc_handles_cross_as_bytes_and_errors_are_one_line(pointer_style):
    from runtime.ipc import HANDLE_BYTES, _Vendor

    v = _Vendor(_FakeIpcApi(pointer_style), "fake")
    ptr = v.malloc(256)
    raw = v.export(ptr)
    assert isinstance(raw, bytes) and len(raw) == HANDLE_BYTES
    assert v.open(raw) == ptr + 1  # the stand-in maps a handle to the exporter's pointer + 1
    with pytest.raises(workspace.EpgenError, match="a handle of 3 bytes"):
        v.open(b"abc")
    v.free(ptr)
    with pytest.raises(workspace.EpgenError, match=r"^IPC workspace: fakeFree failed: 1$"):
        v.free(ptr)
