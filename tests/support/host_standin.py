"""The native backend's whole host side on a CPU: a real NativeBackend (its plan, its argument structs, its workspace
views, its slot maps) built over stand-ins for the device, so the Python an eager call runs can be counted and timed
where there is no GPU (scripts/host_cost.py, tests/runtime/test_host_cost.py).

What is stood in: the device (a CPU "device" reporting the sm_90 target and 132 multiprocessors), the kernels (each
role's real variant and argument signature, whose launch records the grid and returns at once: no driver call), the
workspace (a zeroed CPU tensor, one rank) and the host-mapped error words (plain CPU memory). What is not: every line
of runtime/ between the user's call and the launch. What a CPU device skips: op._follow's stream lookup (0.6 us on the
lent H200 host) and the capture queries the native code only makes on a CUDA device.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import types

import torch
import torch.distributed as dist

from generator.abi import ERROR_WORDS

NUM_SMS = 132


class Arguments:
    """A logged launch's argument values: `as_dict()` -> {name: value}."""

    def __init__(self, names: tuple, values):
        self.names, self.values = names, values

    def as_dict(self) -> dict:
        values = self.values
        if isinstance(values, bytes):
            values = (ctypes.c_int64 * len(self.names)).from_buffer_copy(values)
        return dict(zip(self.names, values))


class StandInRaw:
    """A loaded kernel's stand-in: each launch is logged as (symbol, grid, block, Arguments) with the values
    the driver would have copied (the argument block's fields, or each declared argument), and nothing runs."""

    max_threads = 1024
    launch_path = "stand-in"

    def __init__(self, variant, log: list, record_args: bool = True):
        sig = variant.family.signature
        self.symbol, self.log, self._record = variant.symbol, log, record_args
        self._names, self._struct = tuple(f.name for f in sig.fields), bool(sig.struct)

    def blocks_per_sm(self, threads: int) -> int:
        return max(1, 2048 // threads)

    def launch(self, grid, block, *args):
        from runtime import kernels
        return self.launch_params(grid, block, kernels._params_of(args))

    def launch_params(self, grid, block, params, stream=None):
        if not self._record:
            self.log.append((self.symbol, grid, block, None))
            return 0
        if self._struct:  # one address: the block of 64-bit fields, copied as bytes (decoded when read: host time)
            values = ctypes.string_at(params[0], 8 * len(self._names))
        else:  # one address per argument
            values = tuple(ctypes.c_int64.from_address(params[i]).value for i in range(len(self._names)))
        self.log.append((self.symbol, grid, block, Arguments(self._names, values)))
        return 0

    def close(self):
        pass


class _Patches:
    def __init__(self):
        self._undo = []

    def set(self, obj, name, value):
        self._undo.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    def undo(self):
        for obj, name, value in reversed(self._undo):
            setattr(obj, name, value)
        self._undo.clear()


@contextlib.contextmanager
def standin_device(arch: str = "sm_90", record_args: bool = True):
    """Within: NativeBackend builds on the CPU over stand-ins (module docstring); yields the launch log, a list of
    (symbol, grid, block, Arguments) per launch (StandInRaw; None for the arguments with record_args=False, for
    timings). One gloo rank is initialised if no process group is."""
    from runtime import kernels, workspace
    from runtime.backends import common, native
    from runtime.config import load_specs

    own_group = not dist.is_initialized()
    if own_group:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29577")
        dist.init_process_group("gloo", rank=0, world_size=1)
    log: list = []
    target = load_specs().targets[arch]
    p = _Patches()

    def device_target(probe):
        return torch.device("cpu"), arch, NUM_SMS, target

    def load(v):
        return kernels.Kernel(StandInRaw(v, log, record_args), v)

    def acquire(nbytes, device, group, allocate=None):
        buf = torch.zeros(nbytes, dtype=torch.uint8)
        handle = types.SimpleNamespace(buffer_ptrs=[buf.data_ptr()], buffer_ptrs_dev=None)
        return workspace.Workspace(("standin", nbytes), 1, buf, handle)

    real_setup = native.NativeBackend._setup_workspace

    def setup_workspace(self):
        real_zeros = torch.zeros

        def zeros(*a, pin_memory=False, **kw):  # the error words: plain CPU memory stands for pinned
            return real_zeros(*a, **kw)
        torch.zeros = zeros
        try:
            return real_setup(self)
        finally:
            torch.zeros = real_zeros

    p.set(native, "device_target", device_target)
    p.set(common, "device_target", device_target)
    p.set(kernels, "load", load)
    p.set(kernels, "on_gpu", lambda t: True)  # the stand-in's "device memory" is the CPU's
    p.set(kernels, "host_mapped_pointer", lambda t: t.data_ptr())
    p.set(workspace, "acquire", acquire)
    p.set(workspace, "release", lambda ws: None)
    p.set(native.NativeBackend, "_setup_workspace", setup_workspace)
    p.set(torch.cuda, "is_available", lambda: True)
    p.set(torch.cuda, "synchronize", lambda device=None: None)
    p.set(torch.cuda, "is_current_stream_capturing", lambda: False)
    try:
        yield log
    finally:
        p.undo()
        if own_group:
            dist.destroy_process_group()


def error_words_ok(backend) -> bool:
    """The stand-in's error words (ctypes over CPU memory) read as no error."""
    return all(backend._error_words[i] == 0 for i in range(ERROR_WORDS)) and \
        isinstance(backend._error_words, ctypes.Array)
