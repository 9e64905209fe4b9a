"""The runtime's own peer-mapped workspace: vendor IPC handles exchanged over the process group.

Each rank allocates its workspace with the vendor's allocator (``cudaMalloc`` through cuda-bindings,
``hipMalloc`` through hip-python), exports an IPC handle for it, and all-gathers the handles together
with each rank's device identity (one gather of objects on the op's group, runtime/collectives.py: NCCL or gloo). Every rank
then opens every peer's handle (``cudaIpcOpenMemHandle`` with lazy peer access) and gives the kernels
the same base-pointer table ``torch.distributed._symmetric_memory`` gives: ``buffer_ptrs[r]`` is
rank r's workspace as this process addresses it.

Unlike torch's private symmetric memory this works when several ranks share one GPU (CUDA IPC maps
another process's allocation on the same device: the GPU time-slices the processes, so kernels that
wait on each other make progress — correctness only, never performance), leaks nothing per
exchange, and is one path for both vendors. The HIP side shares everything but the five vendor calls
(``_Vendor``); it has not run on an AMD GPU.

Ranks that share a device are detected from the gathered identities and named in one log line.
"""

from __future__ import annotations

import ctypes
import logging

import attrs
import torch
import torch.distributed as dist

from . import collectives
from .errors import EpgenError

log = logging.getLogger("epgen")

HANDLE_BYTES = 64  # cudaIpcMemHandle_t / hipIpcMemHandle_t: 64 opaque bytes


class _Vendor:
    """The five calls of one vendor's IPC API, returning plain ints and bytes.

    `api` is cuda-bindings' runtime module or hip-python's hip module (tests pass a stand-in): calls
    return (error, value) tuples; a handle struct exposes its 64 bytes through ``getPtr()`` (cuda-bindings)
    or a ``reserved`` field (hip-python's struct of char reserved[64])."""

    def __init__(self, api=None, prefix: str | None = None):
        if api is None:
            if torch.version.hip:
                from hip import hip as api
                prefix = "hip"
            else:
                from cuda.bindings import runtime as api
                prefix = "cuda"
        self.api, self.prefix = api, prefix
        self.ok = getattr(getattr(api, f"{prefix}Error_t"), f"{prefix}Success")
        self.handle_type = getattr(api, f"{prefix}IpcMemHandle_t")
        self.lazy = getattr(api, f"{prefix}IpcMemLazyEnablePeerAccess")

    def _call(self, name: str, *args):
        out = getattr(self.api, self.prefix + name)(*args)
        err, rest = (out[0], out[1:]) if isinstance(out, tuple) else (out, ())
        if err != self.ok:
            raise EpgenError(f"IPC workspace: {self.prefix}{name} failed: {err}")
        return rest[0] if rest else None

    def malloc(self, nbytes: int) -> int:
        return int(self._call("Malloc", nbytes))

    def free(self, ptr: int) -> None:
        self._call("Free", ptr)

    def export(self, ptr: int) -> bytes:
        handle = self._call("IpcGetMemHandle", ptr)
        if hasattr(handle, "getPtr"):
            return ctypes.string_at(int(handle.getPtr()), HANDLE_BYTES)
        return bytes(handle.reserved)[:HANDLE_BYTES]

    def open(self, raw: bytes) -> int:
        if len(raw) != HANDLE_BYTES:
            raise EpgenError(f"IPC workspace: a peer sent a handle of {len(raw)} bytes, expected {HANDLE_BYTES}")
        handle = self.handle_type()
        if hasattr(handle, "getPtr"):
            ctypes.memmove(int(handle.getPtr()), raw, HANDLE_BYTES)
        else:
            handle.reserved = raw
        return int(self._call("IpcOpenMemHandle", handle, self.lazy))

    def close(self, ptr: int) -> None:
        self._call("IpcCloseMemHandle", ptr)


class _Blob:
    """A raw device allocation seen by torch through __cuda_array_interface__ (bytes, 1-D)."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 3, "strides": None}


def device_identity(device: torch.device) -> str:
    """A string naming the physical GPU (its UUID where torch reports one, else the PCI bus id)."""
    props = torch.cuda.get_device_properties(device)
    uuid = getattr(props, "uuid", None)
    return str(uuid) if uuid else f"pci:{getattr(props, 'pci_bus_id', '?')}:{getattr(props, 'pci_device_id', '?')}"


def shared_devices(identities: list[str]) -> dict[str, list[int]]:
    """{device: ranks} for every device that more than one rank uses."""
    ranks: dict[str, list[int]] = {}
    for r, ident in enumerate(identities):
        ranks.setdefault(ident, []).append(r)
    return {d: rs for d, rs in ranks.items() if len(rs) > 1}


@attrs.define
class IpcHandle:
    """Peer base pointers of one IPC workspace (the interface native.py reads: ``buffer_ptrs``)."""
    buffer_ptrs: list[int]
    own_ptr: int
    opened: list[int]          # peer mappings this process opened (closed in close())
    shared: dict[str, list[int]]
    vendor: _Vendor = attrs.field(repr=False)
    closed: bool = False

    def close(self) -> None:
        """Unmap the peers' workspaces and free this rank's (no kernel may use them any more)."""
        if self.closed:
            return
        self.closed = True
        for ptr in self.opened:
            self.vendor.close(ptr)
        self.vendor.free(self.own_ptr)


_logged: set[tuple] = set()


def allocate(nbytes: int, device: torch.device, group) -> tuple[torch.Tensor, IpcHandle]:
    """Collective over `group`: a zeroed `nbytes` workspace on `device` mapped by every rank.

    The allocator signature of runtime.workspace.acquire."""
    vendor = _Vendor()
    with torch.cuda.device(device):
        own = vendor.malloc(nbytes)
        try:
            mine = (vendor.export(own), device_identity(device))
            everyone = collectives.gather_objects(mine, group)
            me = dist.get_rank(group)
            ptrs, opened = [], []
            try:
                for r, (raw, _) in enumerate(everyone):
                    if r == me:
                        ptrs.append(own)
                        continue
                    opened.append(vendor.open(raw))
                    ptrs.append(opened[-1])
            except BaseException:
                for ptr in opened:
                    vendor.close(ptr)
                raise
        except BaseException:
            vendor.free(own)
            raise
        buf = torch.as_tensor(_Blob(own, nbytes), device=device)
        buf.zero_()
    shared = shared_devices([ident for _, ident in everyone])
    key = (group.group_name, tuple(sorted((d, tuple(rs)) for d, rs in shared.items())))
    if shared and key not in _logged:
        _logged.add(key)
        log.warning("epgen: ranks share a GPU (%s): IPC workspace across processes on one device; the GPU "
                    "time-slices them (correctness only, no performance figures)",
                    "; ".join(f"ranks {','.join(map(str, rs))} on {d}" for d, rs in shared.items()))
    return buf, IpcHandle(ptrs, own, opened, shared, vendor)
