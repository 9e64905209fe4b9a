"""bench --floor's kernels and bench --profile-graph on GPUs (one process per GPU, or ranks sharing one: then
the timings mean nothing and only what is asserted here counts): the ping-pong and signal kernels really
synchronize the partners (flag words end equal to the kernels' own counts), a partner that never answers is a
timeout and not a hang, kineto sees the graph's kernels, and a profiled layer loop names its dispatch, copy and
combine kernels, per protocol.

Run: torchrun --nproc-per-node 2 -m pytest -m multigpu -q tests/gpu/test_floor.py
"""

import ctypes
import types

import pytest
import torch
import torch.distributed as dist

from tests.gpu.dist_util import run_collective

pytestmark = pytest.mark.multigpu

if not torch.cuda.is_available() or not dist.is_available():
    pytest.skip("needs GPUs under torchrun", allow_module_level=True)

from bench import floor, profile_graph as pg  # noqa: E402
from bench.records import meta  # noqa: E402

TIMEOUT_NS = 20 * 10**9


def _dev():
    return torch.device("cuda", torch.cuda.current_device())


@pytest.fixture(scope="module")
def floor_parts():
    if dist.get_world_size() % 2:
        pytest.skip("the floor pairs ranks 2i and 2i + 1")
    kern, flags = floor.Kernels(_dev()), floor.Flags(_dev())
    yield kern, flags
    flags.close()
    kern.close()


def test_pingpong_round_trips(floor_parts):
    kern, flags = floor_parts

    def check():
        got = floor.measure_pingpong(kern, flags, rounds=20, reps=3, timeout_ns=TIMEOUT_NS)
        assert got["round_trip_us"] > 0 and got["one_way_us"] == pytest.approx(got["round_trip_us"] / 2)
        torch.cuda.synchronize()
        dist.barrier()
        # the last launch's last round: base + rounds + 1 in both partners' flags
        last = (flags.launches - 1) * 22 + 21
        assert int(flags.buf[4 * floor.PING:4 * floor.PING + 4].view(torch.int32).item()) == last
    run_collective(check)


def test_pingpong_without_a_partner_times_out(floor_parts):
    kern, flags = floor_parts

    def check():
        torch.cuda.synchronize()
        dist.barrier()
        if dist.get_rank() % 2 == 0:  # the partner never launches: a bounded wait, then the failing round
            base = flags.launches * 1000 + 10**6
            kern.pingpong.launch(1, floor.THREADS, ctypes.c_uint64(flags.mine + 4 * floor.PING),
                                 ctypes.c_uint64(flags.theirs + 4 * floor.PING), ctypes.c_int32(5), ctypes.c_int32(1),
                                 ctypes.c_uint32(base), ctypes.c_int64(50 * 10**6), ctypes.c_uint64(flags.out.data_ptr()))
            assert flags.out.tolist() == [0, 1]
        torch.cuda.synchronize()
        dist.barrier()
    run_collective(check)


def test_primitives_are_timed(floor_parts):
    """The primitives kernel's costs are in the range any GPU has (an SM clock of 0.3-4 GHz, an L2 load and an atomic
    of 20 ns to 5 µs) and ordered as the hardware orders them (a block barrier < a dependent L2 load < one past L2)."""
    kern, _ = floor_parts

    def check():
        got = floor.measure_primitives(kern, _dev(), reps=2)
        assert 0.3 < got["sm_clock_ghz"] < 4.0
        assert 20 < got["l2_load_ns"] < 5000 and 20 < got["atomic_ns"] < 5000
        assert 0 < got["barrier_ns"] < got["l2_load_ns"] < got["hbm_load_ns"] < 10000  # past L2 costs more
        assert got["fence_sys_ns"] > 0 and got["fence_release_sys_ns"] > 0 and got["timer_read_ns"] > 0
        assert 0 < got["store16_ns"] < 5000 and 0 < got["store16_volatile_ns"] < 5000
        assert 0 < got["pause_ns"] < 100000
        assert 0 < got["flag_round_tight_ns"] < 100000 and 0 < got["flag_round_pause_ns"] < 100000
        # the code region ran whole on every pass: ~3 instructions a step, one warp issuing at most one a cycle (at
        # most 4 GHz); no order between the passes is asserted (on an H100 all three took 3.4 µs: fetching the code
        # costs nothing measurable)
        assert got["code_steps"] == floor.CODE_STEPS
        for f in ("code_cold_ns", "code_l2_ns", "code_warm_ns"):
            assert 3 * floor.CODE_STEPS / 4.0 < got[f] < 1e6, (f, got[f])
        # the branchy region ran whole on both passes; no order asserted here either (bench --floor reports it)
        assert got["code_jumps"] == floor.JUMP_BLOCKS
        for f in ("code_jumps_first_ns", "code_jumps_second_ns"):
            assert 3 * floor.CODE_STEPS / 4.0 < got[f] < 1e6, (f, got[f])
        # the argument reads ran whole: each region's dependent reads take at least a few cycles each, every pass
        assert got["args_reads"] == floor.ARGS_READS
        for f in floor.ARGS_FIELDS:
            if f != "args_prefetch_ns":  # one warp instruction: no lower bound
                assert 2 * floor.ARGS_READS / 4.0 < got[f] < 1e6, (f, got[f])
        assert 0 <= got["args_prefetch_ns"] < 1e6
        # the drain kernel's step ran whole each way: eight block barriers at least, well under a millisecond
        assert got["drain_stores"] == floor.DRAIN_STORES
        for f in floor.DRAIN_FIELDS:
            if f != "drain_fence_ns":
                assert floor.DRAIN_ROUNDS * 5 < got[f] < 1e6, (f, got[f])
        assert 0 <= got["drain_fence_ns"] < 1e6
        assert got["blocks_launched"] == 1
    run_collective(check)


@pytest.mark.parametrize("method,blocks", [("signal_graph", 1), ("signal_graph", 0), ("empty_graph", 4)])
def test_graph_methods(floor_parts, method, blocks):
    kern, flags = floor_parts

    def check():
        got = floor.measure_graph(kern, flags, method, blocks, layers=4, reps=3, timeout_ns=TIMEOUT_NS)
        assert got["per_kernel_us"] > 0 and got["blocks_launched"] == (blocks or torch.cuda.get_device_properties(
            _dev()).multi_processor_count)
        assert got["kernel_us"] is not None and got["kernel_us"] > 0, "kineto saw no kernel of the replays"
        torch.cuda.synchronize()
        dist.barrier()
        # every signal kernel waited for its partner's: the flag the partner wrote equals this rank's count
        n = int(flags.counter.item())
        assert int(flags.buf[4 * floor.SIGNAL:4 * floor.SIGNAL + 4].view(torch.int32).item()) == n
        assert n > 0 or method == "empty_graph"
        assert int(flags.status.item()) == 0
    run_collective(check)


@pytest.mark.parametrize("protocol", ["ll", "bw"])
def test_profile_graph_point(protocol):
    args = types.SimpleNamespace(hidden=[2048], topk=8, experts=8 * dist.get_world_size(), layers=3, reps=3)

    def check():
        r = pg.profile_point(4, protocol, args, meta(_dev()))
        assert r["kind"] == "kernel_profile" and r["protocol"] == protocol and r["error"] is None
        assert r["roles"]["dispatch"]["calls"] == 3 and r["roles"]["combine"]["calls"] == 3, r["roles"]
        assert r["dispatch_us"] > 0 and r["combine_us"] > 0 and r["per_layer_us"] > 0
        assert r["copy_us"] is not None and r["gap_us"] is not None
        assert ("_ll_" in r["roles"]["dispatch"]["names"][0]) == (protocol == "ll")
    run_collective(check)
