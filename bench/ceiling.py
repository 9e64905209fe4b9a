"""The link's ceiling: ``python -m bench --ceiling`` (one of the layer modes, bench/layer.py; docs/LAYER.md).

torchrun --nproc-per-node 2 -m bench --ceiling [--ceiling-sms 8 16 32 64 132] [--ceiling-mib 64]

Ceiling (kind "ceiling"): moving one buffer to the peer rank ((rank + 1) % world), both directions at
once: a copy kernel (16-byte loads and stores, 1024 threads per block, one block per SM asked for;
the blocks' distinct SMs are read back, "distinct_sms") pushing (local loads, stores to the peer's
memory) or pulling (loads from the peer, local stores) at each SM count; the copy engine
(cuMemcpyAsync through the peer mapping, as Tensor.copy_ does) both ways; NCCL all_to_all_single of the
same bytes. The buffers are the runtime's IPC workspace (runtime.ipc.allocate). GB/s = bytes one rank
moves / time (slowest rank's median). Runs last in a process (after --layer-loop / --layer).
"""

from __future__ import annotations

import ctypes

import torch
import torch.distributed as dist

from .kernels import compile_source
from .measure import collective_try, eager_time, median_us
from .records import meta

CEILING_SMS = (8, 16, 32, 64, 132)
CEILING_THREADS = 1024
COPY_KERNEL = r"""
// 16-byte copy, four vectors in flight per thread; block b notes the SM it ran on in smid[b]
extern "C" __global__ void __launch_bounds__(1024) epg_copy16(const int4* __restrict__ src, int4* __restrict__ dst,
                                                              long long n, int* smid) {
  if (threadIdx.x == 0) { int s; asm volatile("mov.u32 %0, %%smid;" : "=r"(s)); smid[blockIdx.x] = s; }
  const long long stride = (long long)gridDim.x * blockDim.x;
  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  for (; i + 3 * stride < n; i += 4 * stride) {
    int4 a = src[i], b = src[i + stride], c = src[i + 2 * stride], d = src[i + 3 * stride];
    dst[i] = a; dst[i + stride] = b; dst[i + 2 * stride] = c; dst[i + 3 * stride] = d;
  }
  for (; i < n; i += stride) dst[i] = src[i];
}
"""


def compile_copy_kernel(arch: str) -> bytes:
    """The copy kernel's code object for `arch` (compile_source)."""
    return compile_source(arch, COPY_KERNEL, "copy")


def _time_launches(fn, iters: int, reps: int) -> tuple[float, float]:
    """Slowest rank's median (and p99) microseconds of one fn() among `iters` back-to-back calls (bench's
    eager timing: every round after a barrier, a synchronize and a device all_reduce, so a peer's
    previous method cannot overlap; one untimed round first)."""
    ms = eager_time([lambda: [fn() for _ in range(iters)]], reps, warmup=1)[0]
    return median_us([m / iters for m in ms])


def copy_engine(nbytes: int):
    """A function (dst, src) -> None: cuMemcpyAsync of `nbytes` on torch's current stream. The addresses
    are unified: with one of them a peer's IPC mapping the driver moves the bytes over the link with a
    copy engine (what Tensor.copy_ does between device tensors, without a tensor on the peer's memory)."""
    from cuda.bindings import driver as cu

    from runtime.kernels import current_raw_stream

    def copy(dst: int, src: int) -> None:
        res = cu.cuMemcpyAsync(dst, src, nbytes, current_raw_stream())
        err = res[0] if isinstance(res, tuple) else res
        if err != cu.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuMemcpyAsync failed: {err}")
    return copy


def run_ceiling(sms_list=CEILING_SMS, mib: int = 64, iters: int = 10, reps: int = 10) -> list[dict]:
    """The link's ceiling (see the module docstring); collective; one record per (method, SM count).

    The buffers are the runtime's own IPC workspace (runtime.ipc.allocate: the default allocator of the
    ops, no torch symmetric memory in this process); each method that fails is recorded with its reason."""
    from runtime import ipc
    from runtime.kernels import CudaKernel, device_arch

    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device())
    nbytes = mib << 20
    peer, source = (rank + 1) % world, (rank - 1) % world
    torch.cuda.empty_cache()  # what earlier modes left cached goes back: the workspace is a cudaMalloc of its own
    # [A: this rank's data | B: what arrives], zeroed; handle.buffer_ptrs[r]: rank r's buffer as mapped here
    buf, handle = ipc.allocate(2 * nbytes, dev, dist.group.WORLD)
    buf[:nbytes].copy_((torch.arange(nbytes, device=dev) * 7 + rank).to(torch.uint8))
    want = ((torch.arange(nbytes, device=dev) * 7 + source).to(torch.uint8))  # what `source` pushes here
    mine, theirs = int(handle.buffer_ptrs[rank]), int(handle.buffer_ptrs[peer])
    torch.cuda.synchronize()
    dist.barrier()
    n16 = nbytes // 16
    base = {**meta(dev), "kind": "ceiling", "bytes": nbytes, "peer": "(rank + 1) % world, every rank at once",
            "buffers": "runtime.ipc workspace (cudaMalloc + CUDA IPC, peer pointers)"}
    records = []

    def rec(method, sms, us, **kw):
        records.append(dict(base, method=method, sms_used=sms, us=us[0], p99_us=us[1], GBps=nbytes / (us[0] * 1e-6) / 1e9,
                            error=None, **kw))

    def failed(method, sms, reason, **kw):
        records.append(dict(base, method=method, sms_used=sms, us=None, p99_us=None, GBps=None, error=reason, **kw))

    def arrived_ok() -> bool:  # after a push: B holds the source rank's A
        torch.cuda.synchronize()
        dist.barrier()
        ok = bool(torch.equal(buf[nbytes:], want))
        buf[nbytes:].zero_()
        torch.cuda.synchronize()
        dist.barrier()
        return ok

    kern, reason = collective_try(lambda: CudaKernel(compile_copy_kernel(device_arch(dev)), "epg_copy16"))
    if kern is not None:
        smid = torch.zeros(max(sms_list), dtype=torch.int32, device=dev)
        for sms in sms_list:
            for method, src, dst in (("sm_push", mine, theirs + nbytes), ("sm_pull", theirs, mine + nbytes)):
                def launch(src=src, dst=dst, sms=sms):  # (const int4* src, int4* dst, long long n, int* smid)
                    kern.launch(sms, CEILING_THREADS, ctypes.c_uint64(src), ctypes.c_uint64(dst), ctypes.c_int64(n16),
                                ctypes.c_uint64(smid.data_ptr()))
                us, why = collective_try(lambda: _time_launches(launch, iters, reps))
                if why:
                    failed(method, sms, why, threads=CEILING_THREADS)
                    continue
                distinct = len(set(smid[:sms].tolist()))
                ok = arrived_ok() if method == "sm_push" else None
                rec(method, sms, us, threads=CEILING_THREADS, distinct_sms=distinct, data_ok=ok)
        kern.close()
    else:
        failed("sm_push", None, reason)
    copy, reason = collective_try(lambda: copy_engine(nbytes))
    for method, dst, src, note in (("copy_engine_push", theirs + nbytes, mine, "into"),
                                   ("copy_engine_pull", mine + nbytes, theirs, "from")):
        what = f"cuMemcpyAsync {note} the peer's IPC-mapped buffer (copy engine; what Tensor.copy_ does)"
        if copy is None:
            failed(method, None, reason, note=what)
            continue
        us, why = collective_try(lambda: _time_launches(lambda: copy(dst, src), iters, reps))
        if why:
            failed(method, None, why, note=what)
        else:
            rec(method, None, us, note=what, data_ok=arrived_ok() if method == "copy_engine_push" else None)
    send = [nbytes if d == peer else 0 for d in range(world)]
    recv = [nbytes if s == source else 0 for s in range(world)]
    a2a_in, a2a_out = buf[:nbytes].clone(), torch.empty(nbytes, dtype=torch.uint8, device=dev)  # torch's allocator
    what = "all_to_all_single of the same bytes to the same peer (NCCL picks its own SMs)"
    us, why = collective_try(lambda: _time_launches(lambda: dist.all_to_all_single(a2a_out, a2a_in, recv, send),
                                                    iters, reps))
    if why:
        failed("nccl", None, why, note=what)
    else:
        rec("nccl", None, us, note=what)
    torch.cuda.synchronize()
    dist.barrier()  # no peer reads or writes this rank's buffer any more
    buf = None  # its memory is freed next
    handle.close()
    return records
