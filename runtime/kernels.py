"""Variant selection, code-object loading and typed launches for the native backend.

device arch (sm_XY, or gcnArchName -> gfxNNN) + variant name -> generated/<arch>/manifest.json ->
cached code object (compiled on demand, under the cache's file lock, when a toolchain exists) ->
loaded module -> Kernel, launched on torch's current stream with the arguments its family declares
(specs/kernels.toml [args.NAME]): by name, each checked, or as the declared struct.
"""

from __future__ import annotations

import ctypes
import functools
import json
import os
import re
import warnings

import torch

from generator import build as gbuild
from generator import specs as gspecs
from generator import toolchain as gtoolchain
from generator.cache import usable_dir
from generator.model import enumerate_variants

from .config import load_specs
from .errors import EpgenError, LaunchError, VariantMissError


@functools.lru_cache(maxsize=None)
def struct_type(arglist) -> type[ctypes.Structure]:
    """The ctypes mirror of a struct argument list (specs/kernels.toml [args.NAME] with `struct`): one
    64-bit field per declared field, in order, as the template renders the C struct."""
    if not arglist.struct:
        raise LaunchError(f"[args.{arglist.name}] is not a struct argument list")
    return type(arglist.struct, (ctypes.Structure,), {"_fields_": [(f.name, ctypes.c_int64) for f in arglist.fields],
                                                      "__doc__": f"specs/kernels.toml [args.{arglist.name}]"})


def device_arch(device: torch.device) -> str:
    props = torch.cuda.get_device_properties(device)
    gcn = getattr(props, "gcnArchName", "") or ""
    if torch.version.hip and gcn:
        return gcn.split(":")[0]
    return f"sm_{props.major}{props.minor}"


def select(arch: str, name: str):
    """The Variant `name` for `arch`, or VariantMissError naming the key, the reason and what exists."""
    specs = load_specs()
    key = f"{arch}/{name}"
    if arch not in specs.targets:
        raise VariantMissError(f"no variant {key}: target {arch!r} is not declared in specs/targets.toml "
                               f"(declared: {', '.join(specs.targets)})")
    variants, rejected = enumerate_variants(specs, [arch], "all")
    for v in variants:
        if v.name == name:
            manifest = gbuild.generated_root(specs) / arch / "manifest.json"
            if not manifest.exists() and gspecs.is_packaged(specs.root):
                gbuild.write_target(specs, arch)  # installed package: render into the cache dir on first use
            entries = json.loads(manifest.read_text())["variants"] if manifest.exists() else {}
            if name not in entries:
                raise VariantMissError(f"no variant {key} in {manifest}: run python -m generator build --arch {arch}")
            return v
    for r in rejected:
        if r.key == key:
            raise VariantMissError(f"no variant {key}: rejected by rule '{r.rule.name}': {r.rule.message}")
    family = name.split(".")[0]
    near = [v.key for v in variants if v.family.name == family] or [v.key for v in variants][:8]
    raise VariantMissError(f"no variant {key} is declared; nearest available: {', '.join(near)}")


def code_object(v) -> bytes:
    """The compiled, ISA-verified code object of variant v (built into the cache if needed)."""
    try:
        tools = gtoolchain.find(v.toolchain)
    except gtoolchain.ToolchainMissing as e:
        raise VariantMissError(f"{v.key} is not built and cannot be built here ({e}); build it where a "
                               f"toolchain exists: python -m generator build --arch {v.target.name} "
                               f"--only '{v.name}'") from None
    source = gbuild.generated_root(load_specs()) / v.target.name / v.file
    res = gbuild.compile_variant(v, source, usable_dir(), tools, image=True)
    if not res.ok:
        raise EpgenError(f"{v.key}: {res.status}: {res.message}")
    return res.image  # the bytes verified under the entry's lock (the file may change after it)


def _params_of(args: tuple) -> ctypes.Array:
    """The array of argument addresses the driver takes. One argument block (a struct an op keeps for every
    launch) keeps its array on itself: built once, not per launch."""
    if len(args) == 1 and isinstance(args[0], ctypes.Structure):
        params = getattr(args[0], "_epg_params", None)
        if params is None:
            params = args[0]._epg_params = (ctypes.c_void_p * 1)(ctypes.addressof(args[0]))
        return params
    return (ctypes.c_void_p * len(args))(*(ctypes.addressof(a) for a in args))


def struct_params(s: ctypes.Structure) -> ctypes.Array:
    """The driver's argument array of one argument block (kept on the block: built once)."""
    return _params_of((s,))


_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # looked up once: every eager launch asks
_CURRENT_DEVICE = getattr(torch._C, "_cuda_getDevice", None)


def current_raw_stream(device_index: int | None = None) -> int:
    """torch's current stream on the current device (or on device `device_index`), as the driver's handle (the
    cheap way: no Stream object)."""
    if _RAW_STREAM is not None:
        return _RAW_STREAM(_CURRENT_DEVICE() if device_index is None else device_index)
    return torch.cuda.current_stream(device_index).cuda_stream


@functools.lru_cache(maxsize=1)
def _libcuda_launch():
    """libcuda's cuLaunchKernel through ctypes (loaded once), or None where there is no libcuda. No argtypes: the
    launcher (_driver_launch) passes each argument as the C type it must be (c_void_p handles, the parameter array,
    small ints for the unsigned dimensions), which spares ctypes' per-argument conversion (~0.6 µs of a ~1.1 µs
    call on a CPU of ours)."""
    try:
        fn = ctypes.CDLL("libcuda.so.1").cuLaunchKernel
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_int
    return fn


_STREAMS_KEPT = 64  # stream handles a launcher keeps wrapped (c_void_p) before it starts over
_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION (cuda.h)


class _LaunchAttribute(ctypes.Structure):
    """cuda.h's CUlaunchAttribute: the id, padding to 8 bytes, a 64-byte value union (its first int here)."""
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int), ("rest", ctypes.c_char * 60)]


class _LaunchConfig(ctypes.Structure):
    """cuda.h's CUlaunchConfig (cuLaunchKernelEx)."""
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_LaunchAttribute)), ("numAttrs", ctypes.c_uint)]


def _function_handle(function) -> ctypes.c_void_p | None:
    """A CUfunction (or another driver handle: a CUcontext) as the pointer the driver's entry points take, or None (no
    integer handle, or a null one)."""
    try:
        handle = int(function)
    except (TypeError, ValueError):
        return None
    return ctypes.c_void_p(handle) if handle else None


@functools.lru_cache(maxsize=1)
def _libcuda_launch_ex():
    """libcuda's cuLaunchKernelEx through ctypes, or None."""
    try:
        fn = ctypes.CDLL("libcuda.so.1").cuLaunchKernelEx
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_int
    return fn


def _programmatic_launch(function, entry=None):
    """A launcher calling libcuda's cuLaunchKernelEx (or `entry`, a foreign function of its signature: tests) with
    programmatic stream serialization for this CUfunction (a kernel whose code begins with epg_launch_begin's wait:
    it may be launched while the kernel before it finishes), or None where there is no libcuda. The launch
    configuration is built once; a launch sets its grid, block and stream."""
    fn = _libcuda_launch_ex() if entry is None else entry
    handle = _function_handle(function)
    if fn is None or handle is None:
        return None
    attr = _LaunchAttribute(id=_PROGRAMMATIC_STREAM_SERIALIZATION, value=1)
    config = _LaunchConfig(gridDimY=1, gridDimZ=1, blockDimY=1, blockDimZ=1, sharedMemBytes=0,
                           attrs=ctypes.pointer(attr), numAttrs=1)
    config._attr = attr  # kept alive with the config
    ref = ctypes.byref(config)

    def launch(grid: int, block: int, stream: int, params) -> int:
        config.gridDimX, config.blockDimX, config.hStream = grid, block, stream
        return fn(ref, handle, params, None)
    return launch


def _driver_launch(function, entry=None):
    """A launcher calling libcuda's cuLaunchKernel (or `entry`, a foreign function of its signature: tests) through
    ctypes for this CUfunction, or None (then cuda-bindings launches). Python-side launch cost is most of an eager
    call's host time, so what does not change is wrapped once: the function handle, and each stream's handle the
    first time it is seen; the parameter array goes as it is (ctypes passes an array as its address). The grid and
    block dimensions are ints below 2**31 (C int, the same bits as the driver's unsigned int)."""
    fn = _libcuda_launch() if entry is None else entry
    handle = _function_handle(function)
    if fn is None or handle is None:
        return None
    streams: dict[int, ctypes.c_void_p] = {}

    def launch(grid: int, block: int, stream: int, params) -> int:
        s = streams.get(stream)
        if s is None:
            if len(streams) >= _STREAMS_KEPT:
                streams.clear()
            s = streams[stream] = ctypes.c_void_p(stream)
        return fn(handle, grid, 1, 1, block, 1, 1, 0, s, params, None)
    return launch


class CudaKernel:
    """A kernel from a cubin, loaded with cuda-bindings, launched on torch's current stream."""

    def __init__(self, image: bytes, symbol: str, programmatic: bool = False):
        from cuda.bindings import driver as cu

        self._cu = cu
        # the context this kernel lives in: a thread where no CUDA call made it current yet (autograd's backward
        # worker, a user's thread) gets it made current before a launch (_in_context)
        self._ctx = self._check(cu.cuCtxGetCurrent(), "cuCtxGetCurrent")
        if _function_handle(self._ctx) is None:  # none current (no CUDA work in this process yet): torch makes the
            torch.zeros(1, device=torch.device("cuda", torch.cuda.current_device()))  # device's primary context
            self._ctx = self._check(cu.cuCtxGetCurrent(), "cuCtxGetCurrent")
        self._no_context = int(cu.CUresult.CUDA_ERROR_INVALID_CONTEXT)
        self.module = self._check(cu.cuModuleLoadData(image), "cuModuleLoadData")
        self.function = self._check(cu.cuModuleGetFunction(self.module, symbol.encode()), "cuModuleGetFunction")
        self.symbol = symbol
        # the most threads per block this kernel can launch with (its registers per thread decide)
        self.max_threads = int(self._check(cu.cuFuncGetAttribute(
            cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK, self.function), "cuFuncGetAttribute"))
        self._occupancy: dict[int, int] = {}
        # programmatic: launched with programmatic stream serialization (runtime.kernels.programmatic_launch)
        pdl = _programmatic_launch(self.function) if programmatic else None
        self._fast = pdl or _driver_launch(self.function)
        self.launch_path = ("libcuda (ctypes, programmatic)" if pdl is not None else
                            "libcuda (ctypes)" if self._fast is not None else "cuda-bindings")

    def blocks_per_sm(self, threads: int) -> int:
        """Blocks of `threads` threads that can be resident on one multiprocessor at once (at least 1)."""
        if threads not in self._occupancy:
            try:
                n = self._check(self._in_context(lambda: self._cu.cuOccupancyMaxActiveBlocksPerMultiprocessor(
                    self.function, threads, 0)), "cuOccupancyMaxActiveBlocksPerMultiprocessor")
            except Exception as e:  # noqa: BLE001 - one block per SM is always resident: the safe answer
                warnings.warn(f"{self.symbol}: occupancy query failed ({e}); assuming one block per SM")
                n = 1
            self._occupancy[threads] = max(1, int(n))
        return self._occupancy[threads]

    def _in_context(self, call):
        """call() (a driver call: its CUresult first), again after making this kernel's context current if the
        calling thread had none (CUDA_ERROR_INVALID_CONTEXT: a thread that made no CUDA call yet)."""
        result = call()
        err = result[0] if isinstance(result, tuple) else result
        if int(err) == self._no_context and self._ctx is not None:
            self._check(self._cu.cuCtxSetCurrent(self._ctx), "cuCtxSetCurrent")
            result = call()
        return result

    def _check(self, result, what):
        err, *rest = result if isinstance(result, tuple) else (result,)
        if err != self._cu.CUresult.CUDA_SUCCESS:
            raise EpgenError(f"{what} failed for {getattr(self, 'symbol', '?')}: {err}")
        return rest[0] if len(rest) == 1 else (rest or None)

    def launch(self, grid: int, block: int, *args: ctypes._SimpleCData | ctypes.Structure) -> int:
        """Launch on torch's current stream; args are ctypes values (the driver copies them). Returns
        the stream's handle. (A code object of the bench's own; a family's variant launches through
        Kernel, by its declared arguments.)"""
        return self.launch_params(grid, block, _params_of(args))

    def launch_params(self, grid: int, block: int, params, stream: int | None = None) -> int:
        """Launch with a ready array of parameter addresses, on `stream` (a driver handle the caller looked up for
        this call) or torch's current stream."""
        if stream is None:
            stream = current_raw_stream()
        if self._fast is not None:  # the driver's entry point through ctypes: a few us less per launch
            err = self._fast(grid, block, stream, params)
            if err == self._no_context:  # a thread with no context yet: once more, in this kernel's context
                err = self._in_context(lambda: self._fast(grid, block, stream, params))
            if err:
                raise EpgenError(f"cuLaunchKernel({self.symbol}) failed: CUresult {err}")
            return stream
        self._check(self._in_context(lambda: self._cu.cuLaunchKernel(
            self.function, grid, 1, 1, block, 1, 1, 0, stream, ctypes.addressof(params), 0)),
            f"cuLaunchKernel({self.symbol})")
        return stream

    def close(self) -> None:
        if self.module is not None:
            self._cu.cuModuleUnload(self.module)
            self.module = None


class HipKernel:
    """A kernel from an hsaco, loaded with hip-python (not yet run on AMD hardware)."""

    def __init__(self, image: bytes, symbol: str):
        from hip import hip

        self._hip = hip
        self.symbol = symbol
        self.module = self._check(hip.hipModuleLoadData(image), "hipModuleLoadData")
        self.function = self._check(hip.hipModuleGetFunction(self.module, symbol.encode()), "hipModuleGetFunction")
        # the most threads per block this kernel can launch with; 1024 (the hardware limit, so no check)
        # where this hip-python lacks the attribute query
        attrs = getattr(hip, "hipFunction_attribute", None)
        attr = getattr(attrs, "HIP_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK", None)
        self.max_threads = 1024 if attr is None else int(self._check(hip.hipFuncGetAttribute(attr, self.function),
                                                                     "hipFuncGetAttribute"))

    def blocks_per_sm(self, threads: int) -> int:
        """Blocks of `threads` threads resident per compute unit at once; 1 (the safe answer) where this
        hip-python lacks the occupancy query."""
        query = getattr(self._hip, "hipModuleOccupancyMaxActiveBlocksPerMultiprocessor", None)
        if query is None:
            return 1
        return max(1, int(self._check(query(self.function, threads, 0), "hipModuleOccupancyMaxActiveBlocksPerMultiprocessor")))

    def _in_context(self, call):
        """call() (a driver call: its CUresult first), again after making this kernel's context current if the
        calling thread had none (CUDA_ERROR_INVALID_CONTEXT: a thread that made no CUDA call yet)."""
        result = call()
        err = result[0] if isinstance(result, tuple) else result
        if int(err) == self._no_context and self._ctx is not None:
            self._check(self._cu.cuCtxSetCurrent(self._ctx), "cuCtxSetCurrent")
            result = call()
        return result

    def _check(self, result, what):
        err, *rest = result if isinstance(result, tuple) else (result,)
        if err != self._hip.hipError_t.hipSuccess:
            raise EpgenError(f"{what} failed for {self.symbol}: {err}")
        return rest[0] if len(rest) == 1 else (rest or None)

    def launch(self, grid: int, block: int, *args: ctypes._SimpleCData | ctypes.Structure) -> int:
        return self.launch_params(grid, block, _params_of(args))

    def launch_params(self, grid: int, block: int, params, stream: int | None = None) -> int:
        if stream is None:
            stream = current_raw_stream()
        self._check(self._hip.hipModuleLaunchKernel(self.function, grid, 1, 1, block, 1, 1, 0, stream,
                                                    ctypes.addressof(params), None), f"hipModuleLaunchKernel({self.symbol})")
        return stream

    def close(self) -> None:
        if self.module is not None:
            self._hip.hipModuleUnload(self.module)
            self.module = None


def host_mapped_pointer(t: torch.Tensor) -> int:
    """Device address of a pinned host tensor (the same address under unified addressing)."""
    if torch.version.hip:
        from hip import hip
        err, ptr = hip.hipHostGetDevicePointer(t.data_ptr(), 0)
        return int(ptr) if err == hip.hipError_t.hipSuccess else t.data_ptr()
    from cuda.bindings import driver as cu
    err, ptr = cu.cuMemHostGetDevicePointer(t.data_ptr(), 0)
    return int(ptr) if err == cu.CUresult.CUDA_SUCCESS else t.data_ptr()


def on_gpu(t: torch.Tensor) -> bool:
    """Is t in device memory (CUDA or HIP)? A host tensor's address would fault the kernel."""
    return t.is_cuda


_POINTEE_DTYPES = {"i32": torch.int32, "f32": torch.float32}  # pointees a tensor's dtype must match (char, void: any)
_I64 = (-(1 << 63), (1 << 63) - 1)


def _block(n: int):
    """An argument block of n 64-bit values and the array of their addresses the driver takes."""
    values = (ctypes.c_int64 * n)()
    return values, (ctypes.c_void_p * n)(*(ctypes.addressof(values) + 8 * i for i in range(n)))


class Kernel:
    """A loaded variant of a family, launched with the arguments its family declares (specs/kernels.toml
    [args.NAME], `signature`): `launch(grid, block, name=value, ...)`, every declared name given once, a
    tensor (its device address; None where the argument is optional) for a pointer, whose dtype matches
    i32 / f32 pointees, an int for i64; a struct list takes its one ctypes struct (`struct_type`). Anything
    else is a LaunchError naming the family and the argument, raised before the launch. `bind(**fixed)`
    checks the arguments that stay the same once and returns a launcher taking only the others."""

    def __init__(self, raw: "CudaKernel | HipKernel", variant):
        signature = variant.family.signature
        self.raw, self.variant, self.family, self.signature = raw, variant, variant.family.name, signature
        self.symbol, self.max_threads = raw.symbol, raw.max_threads
        self.launch_path = getattr(raw, "launch_path", "hip-python")
        self.limits = dict(signature.limits)
        self._values, self._params = _block(1 if signature.struct else len(signature.fields))
        self._struct = struct_type(signature) if signature.struct else None
        self._fields = tuple((i, a.name, a.pointer, a.optional, _POINTEE_DTYPES.get(a.pointee))
                             for i, a in enumerate(signature.fields))

    def blocks_per_sm(self, threads: int) -> int:
        return self.raw.blocks_per_sm(threads)

    def _bad(self, name: str, why: str) -> LaunchError:
        return LaunchError(f"{self.family} ({self.symbol}): argument {name!r} {why} "
                           f"(specs/kernels.toml [args.{self.signature.name}])")

    def _fill(self, values, fields: tuple, kw: dict) -> None:
        """Each of `fields` from kw into `values`, checked; kw must hold exactly those names."""
        for i, name, pointer, optional, dtype in fields:
            try:
                v = kw[name]
            except KeyError:
                raise self._bad(name, "is missing") from None
            if pointer:
                if v is None:
                    if not optional:
                        raise self._bad(name, "is required (None given)")
                    values[i] = 0
                    continue
                if not isinstance(v, torch.Tensor):
                    raise self._bad(name, f"must be a tensor, got {type(v).__name__}")
                if dtype is not None and v.dtype != dtype:
                    raise self._bad(name, f"must be a {dtype} tensor, got {v.dtype}")
                if not on_gpu(v):
                    raise self._bad(name, f"must be a tensor on the GPU, got one on {v.device}")
                values[i] = v.data_ptr()
            else:
                if type(v) is not int:  # noqa: E721 - bool, float, tensor: all mistakes here
                    raise self._bad(name, f"must be an int, got {type(v).__name__}")
                if not _I64[0] <= v <= _I64[1]:
                    raise self._bad(name, f"= {v} does not fit in 64 bits")
                values[i] = v
        if len(kw) != len(fields):
            unknown = sorted(set(kw) - {f[1] for f in fields})
            known = {f[1] for f in self._fields}
            raise self._bad(unknown[0], "is not declared" if unknown[0] not in known else "is bound already")

    def launch(self, grid: int, block: int, args: ctypes.Structure | None = None, /, **kw) -> int:
        """Launch on torch's current stream; returns the stream's handle."""
        if self._struct is not None:
            if kw or not isinstance(args, self._struct):
                raise LaunchError(f"{self.family} ({self.symbol}) takes one {self.signature.struct} "
                                  f"(runtime.kernels.struct_type), got {type(args).__name__}"
                                  + (f" and {', '.join(kw)}" if kw else ""))
            return self.raw.launch(grid, block, args)
        if args is not None:
            raise LaunchError(f"{self.family} ({self.symbol}) takes its arguments by name, not positionally")
        self._fill(self._values, self._fields, kw)
        return self.raw.launch_params(grid, block, self._params)

    def bind(self, **fixed) -> "BoundKernel":
        """A launcher with `fixed` checked and stored once (an op's persistent buffers and sizes: the tensors
        must outlive it); its launch(grid, block, **rest) takes exactly the other declared arguments."""
        if self._struct is not None:
            raise LaunchError(f"{self.family} ({self.symbol}) takes one {self.signature.struct}: nothing to bind")
        return BoundKernel(self, fixed)

    def close(self) -> None:
        self.raw.close()


class BoundKernel:
    """Kernel.bind's launcher: a block of its own with the bound arguments in place."""

    def __init__(self, kernel: Kernel, fixed: dict):
        self.kernel = kernel
        self._values, self._params = _block(len(kernel._fields))
        bound = tuple(f for f in kernel._fields if f[1] in fixed)
        kernel._fill(self._values, bound, fixed)
        self._rest = tuple(f for f in kernel._fields if f[1] not in fixed)

    def launch(self, grid: int, block: int, **rest) -> int:
        self.kernel._fill(self._values, self._rest, rest)
        return self.kernel.raw.launch_params(grid, block, self._params)


PROGRAMMATIC_LAUNCH_ENV = "EPGEN_PROGRAMMATIC_LAUNCH"


def programmatic_launch(target) -> bool:
    """Whether `target`'s kernels are launched with programmatic stream serialization: its specs/targets.toml fact
    (the kernels then begin with the wait it needs), unless the environment's EPGEN_PROGRAMMATIC_LAUNCH is 0 (unset
    or 1: the fact decides; 1 never turns it on for a target whose kernels have no wait)."""
    value = os.environ.get(PROGRAMMATIC_LAUNCH_ENV, "").strip()
    if not re.fullmatch(r"[01]?", value):
        raise EpgenError(f"environment {PROGRAMMATIC_LAUNCH_ENV}={value!r}: must be 0 (plain launches) or 1 / unset "
                         f"(the target's programmatic_launch in specs/targets.toml)")
    return bool(target.programmatic_launch) and value != "0"


def load(v) -> Kernel:
    """Variant v's code object, loaded, as a Kernel launched by its family's declared arguments."""
    image = code_object(v)
    raw = (CudaKernel(image, v.symbol, programmatic=programmatic_launch(v.target)) if v.target.vendor == "nvidia"
           else HipKernel(image, v.symbol))
    return Kernel(raw, v)
