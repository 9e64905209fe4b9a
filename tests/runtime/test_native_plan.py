"""The native backend's plan (variant names, row sizes, workspace) for each config mode, on CPU."""

import attrs
import pytest
import torch

from runtime import EpDispatchCombineConfig, kernels
from runtime.config import load_specs
from runtime.errors import InputError
from runtime.plan import Plan

BASE = dict(rank=0, world_size=2, hidden_dim=7168, max_num_inp_token_per_rank=64, num_experts_per_rank=8,
            num_experts_per_token=4, kernel_backend="torch")
MODES = {
    "bf16": dict(),
    "fp32_scatter": dict(data_type=torch.float32, combine_mode="scatter"),
    "fp8_payload": dict(dispatch_data_type=torch.float8_e4m3fn, combine_data_type=torch.bfloat16, scale_dim=56,
                        scale_type_size=4),
    "fp4_payload": dict(dispatch_data_type=torch.float4_e2m1fn_x2, combine_data_type=torch.bfloat16, scale_dim=224,
                        scale_type_size=1),
    "fp8_quant": dict(dispatch_quant_type="fp8_blockwise", quant_type="fp8_blockwise"),
    "fp4_quant": dict(dispatch_quant_type="fp4_blockwise", quant_type="fp4_blockwise"),
    "fp8_direct": dict(quant_type="fp8_direct_cast"),
}


@pytest.mark.parametrize("arch", ["sm_90", "gfx950", "gfx1250", "gfx942"])
@pytest.mark.parametrize("mode", sorted(MODES))
def test_plan_names_declared_variants(arch, mode):
    cfg = EpDispatchCombineConfig(**BASE, **MODES[mode])
    target = load_specs().targets[arch]
    misses = {("gfx942", "fp4_quant"): "fp4_conversion_target",  # no FP4 conversion instructions
              ("gfx942", "fp8_payload"): "fp8_native_ocp"}          # gfx942 payloads are float8_e4m3fnuz
    if (arch, mode) in misses:
        with pytest.raises(kernels.VariantMissError, match=misses[arch, mode]):
            kernels.select(arch, Plan.of(cfg, target).dispatch_variant)
        return
    plan = Plan.of(cfg, target)
    for name in (plan.dispatch_variant, plan.combine_variant):
        assert kernels.select(arch, name).name == name
    if arch == "gfx942" and mode in ("fp8_quant", "fp8_direct"):
        assert "fp8_e4m3fnuz" in plan.combine_variant


def test_plan_sizes():
    t = load_specs().targets["sm_90"]
    p = Plan.of(EpDispatchCombineConfig(**BASE, **MODES["fp8_quant"]), t)
    assert (p.in_row, p.wire_row, p.scale_row, p.scale_cols) == (7168 * 2, 7168, 56 * 4, 56)
    assert p.out_dtype == torch.float8_e4m3fn and p.scatter and (p.scat_row, p.scat_scale_row) == (7168, 56 * 4)
    p = Plan.of(EpDispatchCombineConfig(**BASE, **MODES["fp4_payload"]), t)
    assert (p.in_row, p.wire_row, p.scale_row, p.out_cols) == (3584, 3584, 224, 3584)
    lay = Plan.of(EpDispatchCombineConfig(**BASE), t).layout(EpDispatchCombineConfig(**BASE))
    R = 128
    assert lay["total"] >= 2 * R * 7168 * 2 and lay["comb_x"] % 256 == 0


@pytest.mark.parametrize("value,mode", [(None, "async"), ("", "async"), ("async", "async"), ("1", "sync"),
                                        ("SYNC", "sync"), ("0", "off"), ("off", "off")])
def test_expert_id_check_mode_from_environment(monkeypatch, value, mode):
    from runtime.backends.common import ID_CHECK_ENV, id_check_mode

    if value is None:
        monkeypatch.delenv(ID_CHECK_ENV, raising=False)
    else:
        monkeypatch.setenv(ID_CHECK_ENV, value)
    assert id_check_mode() == mode


def test_expert_id_check_mode_rejects_other_values(monkeypatch):
    from runtime.errors import EpgenError
    from runtime.backends.common import ID_CHECK_ENV, id_check_mode

    monkeypatch.setenv(ID_CHECK_ENV, "yes")
    with pytest.raises(EpgenError, match="EPGEN_CHECK_EXPERT_IDS='yes': must be one of async, sync, off"):
        id_check_mode()


def _checker(id_check="async"):
    import ctypes
    import types

    from generator.abi import ERROR_WORDS

    error = torch.zeros(ERROR_WORDS, dtype=torch.int32)
    return types.SimpleNamespace(error=error, id_check=id_check, _late_words=0, _bad_seen=0,
                                 _error_words=(ctypes.c_int32 * ERROR_WORDS).from_address(error.data_ptr()),
                                 config=EpDispatchCombineConfig(**BASE))


def test_noted_bad_expert_id_is_reported_once():
    """The dispatch kernel's note in the host-mapped error word ([5] count, [6] id, [7] written) becomes
    one report naming the id: InputError from op.check(), InputWarning from an eager call (raising on one
    rank there would leave its peers waiting), nothing from the check after a launch; then it is cleared."""
    from runtime.errors import InputError, InputWarning
    from runtime.backends.native import NativeBackend

    fake = _checker()
    NativeBackend.check(fake)  # nothing noted
    fake.error[5], fake.error[6], fake.error[7] = 3, 999, 1
    n = fake.config.num_experts
    NativeBackend.check(fake, ids="skip")  # after a launch: left for the next report
    with pytest.raises(InputError, match=rf"expert id 999 >= num_experts={n} \(world_size × num_experts_per_rank = 2 × 8 = {n};.*\(3 such id\(s\)"):
        NativeBackend.check(fake)
    assert fake.error[5:8].tolist() == [0, 0, 0]
    NativeBackend.check(fake)  # reported once
    fake.error[5], fake.error[6], fake.error[7] = 1, 777, 1
    with pytest.warns(InputWarning, match="expert id 777"):
        NativeBackend.check(fake, ids="warn")
    NativeBackend.check(fake)  # the warning was the report
    off = _checker("off")
    off.error[5], off.error[6], off.error[7] = 1, 999, 1
    NativeBackend.check(off)  # "off": cleared, not raised
    assert off.error[5:8].tolist() == [0, 0, 0]


def test_a_timeout_is_reported_before_a_noted_bad_id():
    from runtime.errors import EpTimeoutError
    from runtime.backends.native import NativeBackend

    fake = _checker()
    fake.error[:8] = torch.tensor([1, 0, 1, 2, 1, 1, 999, 1], dtype=torch.int32)
    with pytest.raises(EpTimeoutError, match="on rank 0 waiting for rank 1 in the dispatch arrival wait"):
        NativeBackend.check(fake)


def test_launch_falls_back_to_cuda_bindings_without_a_handle():
    from runtime.kernels import _driver_launch

    assert _driver_launch(object()) is None  # no integer handle: cuda-bindings launches


def test_driver_launch_passes_cuLaunchKernels_arguments_as_their_c_types():
    """The launcher calls the driver's entry point without ctypes argtypes (the conversion costs half the call), so
    each argument must reach C as what cuLaunchKernel declares: a C function of that signature (a ctypes callback
    behind an untyped foreign function, as libcuda's is) receives the function and stream handles as 64-bit
    pointers, the dimensions as unsigned ints, the parameter array's address and a null extra; the default stream
    (0) arrives as a null pointer; more streams than the launcher keeps wrapped still arrive as themselves."""
    import ctypes

    from runtime import kernels

    seen = []
    proto = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, *[ctypes.c_uint] * 7, *[ctypes.c_void_p] * 3)
    callback = proto(lambda *a: seen.append(a) or 7)
    entry = ctypes.CDLL(None)._FuncPtr(ctypes.cast(callback, ctypes.c_void_p).value)
    entry.restype = ctypes.c_int
    handle, stream = 0x7F00_1111_2222, 0x7EFF_DEAD_BEE0  # above 2**32: a truncated pointer would show
    launch = kernels._driver_launch(handle, entry)
    params = (ctypes.c_void_p * 1)(12345)
    assert launch(132, 512, stream, params) == 7
    assert launch(3, 64, 0, params) == 7
    assert seen == [(handle, 132, 1, 1, 512, 1, 1, 0, stream, ctypes.addressof(params), None),
                    (handle, 3, 1, 1, 64, 1, 1, 0, None, ctypes.addressof(params), None)]
    for s in range(kernels._STREAMS_KEPT + 3):  # past the bound of wrapped streams (the cache starts over)
        launch(1, 32, 0x1000 + s, params)
    assert seen[-1][8] == 0x1000 + kernels._STREAMS_KEPT + 2
    assert kernels._driver_launch(0, entry) is None  # a null function: cuda-bindings launches


def test_launch_config_matches_cuda_h():
    """cuLaunchKernelEx's CUlaunchConfig and CUlaunchAttribute as cuda.h lays them out (64-bit): the attribute's id,
    padding to 8 bytes, a 64-byte value union; the config's six dimensions and shared bytes, the stream at 32."""
    import ctypes

    from runtime import kernels

    a, c = kernels._LaunchAttribute, kernels._LaunchConfig
    assert (ctypes.sizeof(a), a.value.offset) == (72, 8)
    assert (ctypes.sizeof(c), c.sharedMemBytes.offset, c.hStream.offset, c.attrs.offset, c.numAttrs.offset) == (
        56, 24, 32, 40, 48)
    assert kernels._PROGRAMMATIC_STREAM_SERIALIZATION == 6


def test_programmatic_launch_passes_its_config_to_cuLaunchKernelEx():
    """The programmatic launcher hands cuLaunchKernelEx a config with the launch's grid, block and stream and one
    attribute, programmatic stream serialization allowed (= 1), then the function, the parameter array and a null
    extra; a null function or no handle gets no launcher."""
    import ctypes

    from runtime import kernels

    seen = []

    def call(config, function, params, extra):
        cfg = ctypes.cast(config, ctypes.POINTER(kernels._LaunchConfig)).contents
        attr = cfg.attrs[0]
        seen.append((cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ, cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ,
                     cfg.sharedMemBytes, cfg.hStream, cfg.numAttrs, attr.id, attr.value, function, params, extra))
        return 5

    proto = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)
    callback = proto(call)
    entry = ctypes.CDLL(None)._FuncPtr(ctypes.cast(callback, ctypes.c_void_p).value)
    entry.restype = ctypes.c_int
    handle, stream = 0x7F00_1111_2222, 0x7EFF_DEAD_BEE0
    launch = kernels._programmatic_launch(handle, entry)
    params = (ctypes.c_void_p * 1)(12345)
    assert launch(132, 512, stream, params) == 5
    assert launch(3, 64, 0, params) == 5
    assert seen == [(132, 1, 1, 512, 1, 1, 0, stream, 1, 6, 1, handle, ctypes.addressof(params), None),
                    (3, 1, 1, 64, 1, 1, 0, None, 1, 6, 1, handle, ctypes.addressof(params), None)]
    assert kernels._programmatic_launch(0, entry) is None
    assert kernels._programmatic_launch(object(), entry) is None


@pytest.mark.parametrize("value,want", [(None, True), ("", True), ("1", True), (" 1 ", True), ("0", False)])
def test_programmatic_launch_follows_the_target_and_the_environment(monkeypatch, specs, value, want):
    from runtime.kernels import PROGRAMMATIC_LAUNCH_ENV, programmatic_launch

    if value is None:
        monkeypatch.delenv(PROGRAMMATIC_LAUNCH_ENV, raising=False)
    else:
        monkeypatch.setenv(PROGRAMMATIC_LAUNCH_ENV, value)
    assert programmatic_launch(specs.targets["sm_90"]) is want
    assert programmatic_launch(specs.targets["gfx942"]) is False  # its kernels have no wait: never


@pytest.mark.parametrize("value", ["yes", "2", "true", "0 1"])
def test_programmatic_launch_environment_is_validated(monkeypatch, specs, value):
    from runtime.errors import EpgenError
    from runtime.kernels import PROGRAMMATIC_LAUNCH_ENV, programmatic_launch

    monkeypatch.setenv(PROGRAMMATIC_LAUNCH_ENV, value)
    with pytest.raises(EpgenError, match="EPGEN_PROGRAMMATIC_LAUNCH=.*must be 0"):
        programmatic_launch(specs.targets["sm_90"])


@pytest.mark.parametrize("arch", ["sm_90", "gfx942"])
def test_rows_of_whole_8_element_groups(arch):
    """fp32 rows of 4 mod 8 elements are whole 16-byte vectors but not whole 8-element groups: the
    scatter, conversion and std-MoE kernels would leave the tail unwritten or overrun the row."""
    from runtime.errors import EpgenError
    from runtime.backends.native import check_rows

    target = load_specs().targets[arch]
    cfg = EpDispatchCombineConfig(**dict(BASE, hidden_dim=20, data_type=torch.float32))
    with pytest.raises(EpgenError, match="hidden_dim must be a multiple of 8, got 20"):
        check_rows(cfg, Plan.of(cfg, target))
    ok = EpDispatchCombineConfig(**dict(BASE, hidden_dim=24, data_type=torch.float32))
    check_rows(ok, Plan.of(ok, target))  # 96-byte rows: fine


@pytest.mark.parametrize("arch,threads,bad", [("gfx942", 96, True), ("gfx942", 32, True), ("gfx942", 128, False),
                                              ("sm_90", 96, False)])
def test_launch_threads_whole_waves(arch, threads, bad):
    """A block of a partial wave would take another block's rows (dispatch) or loop forever (scatter)."""
    import types

    from runtime.errors import EpgenError
    from runtime.backends.native import NativeBackend

    kern = types.SimpleNamespace(max_threads=1024, symbol="k")
    fake = types.SimpleNamespace(config=EpDispatchCombineConfig(**dict(BASE, launch_threads=threads)), arch=arch,
                                 wave=load_specs().targets[arch].wave_size, k={"dispatch": kern, "combine": kern})
    if bad:
        with pytest.raises(EpgenError, match=f"launch_threads: {threads} threads per block is not a whole number of "
                                             f"64-lane waves on {arch}"):
            NativeBackend._check_geometry(fake)
    else:
        NativeBackend._check_geometry(fake)


GROUPED = dict(BASE, hidden_dim=256, enable_grouped_layout=True)


@pytest.mark.parametrize("fields,direct", [
    (dict(), True),
    (dict(data_type=torch.float32), True),
    (dict(dispatch_quant_type="fp8_blockwise"), False),        # quantized on the way
    (dict(dispatch_data_type=torch.float8_e4m3fn, combine_data_type=torch.bfloat16, scale_dim=2,
          scale_type_size=4), False),                           # a pre-quantized payload with scales
    (dict(max_total_recv_tokens=100), False),                   # a receive cap: rows may be dropped on arrival
    (dict(num_experts_per_rank=700), True),                     # 1402 counters of 1536
    (dict(num_experts_per_rank=800), False),                    # 1602: past the kernel's shared memory
    (dict(enable_grouped_layout=False), False),
    (dict(max_num_inp_token_per_rank=1 << 21), True),           # plan.DIRECT_MAX_TOKENS: the split's 32-bit bound
    (dict(max_num_inp_token_per_rank=(1 << 21) + 1), False),
])
def test_direct_grouped_dispatch_plan(fields, direct):
    """Which ops the direct grouped dispatch (dispatch_direct.j2) may serve, and what that changes: its variant among
    the roles, and the buffers its peers write (the grouped rows, their pair ids / experts / weights, the pair map,
    the count table) in the symmetric workspace instead of local memory, moved and not added; the count table before
    recv_x (reset() zeroes it with the counters)."""
    cfg = EpDispatchCombineConfig(**{**GROUPED, **fields})
    plan = Plan.of(cfg, load_specs().targets["sm_90"])
    assert plan.direct == direct
    assert ("dispatch_direct" in dict(plan.roles)) == direct
    regions = {r.name: r for r in plan.slot_regions(cfg)}
    if not cfg.enable_grouped_layout:
        return
    P, R, k, E, W = (cfg.resolved_grouped_capacity, cfg.max_recv_tokens, cfg.num_experts_per_token,
                     cfg.num_experts_per_rank, cfg.world_size)
    if not direct:
        assert regions["grouped_x"].where == "local" and "grouped_cnt" not in regions
        return
    name = f"dispatch_direct.{'fp32' if cfg.data_type == torch.float32 else 'bf16'}.intranode"
    assert plan.variant("dispatch_direct") == name and kernels.select("sm_90", name).name == name
    assert regions["grouped_x"].where == "workspace" and regions["grouped_x"].nbytes == P * plan.grouped_row
    assert regions["grouped_rows"].nbytes == 12 * P and regions["grouped_map"].nbytes == 4 * R * k
    assert regions["grouped_cnt"].nbytes == 8 * 2 * W * (E + 1)  # (tag, count) words, two parities
    assert regions["grouped_meta"].where == "local" and regions["grouped_meta"].nbytes == 4 * R * k + 12 * E + 4
    layout = plan.layout(cfg)
    assert layout["counter"] < layout["grouped_cnt"] < layout["recv_x"]
    # moved, not added: the direct op's grouped bytes are the other layout's plus the table
    plain = {r.name: r.nbytes for r in attrs.evolve(plan, direct=False).slot_regions(cfg)}
    mine = {r.name: r.nbytes for r in plan.slot_regions(cfg)}
    assert sum(mine.values()) == sum(plain.values()) + regions["grouped_cnt"].nbytes


def test_cuda_kernel_makes_the_context_where_no_cuda_work_came_first(monkeypatch):
    """A process whose first CUDA work is loading an epgen kernel (a gloo group, no tensor on the GPU yet) has no
    current context: the module would not load (CUDA_ERROR_INVALID_CONTEXT, seen on the GPU). CudaKernel has torch
    make the device's primary context first, and keeps the context that is then current."""
    import sys
    import types

    calls = []
    ctx = [0]  # the current context's handle: none until torch allocates
    ok = types.SimpleNamespace(CUDA_SUCCESS=0, CUDA_ERROR_INVALID_CONTEXT=201)

    def load(image):
        calls.append("load")
        return (ok.CUDA_SUCCESS if ctx[0] else ok.CUDA_ERROR_INVALID_CONTEXT, 7)

    driver = types.SimpleNamespace(
        CUresult=ok, CUfunction_attribute=types.SimpleNamespace(CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK=0),
        cuCtxGetCurrent=lambda: (ok.CUDA_SUCCESS, ctx[0]), cuModuleLoadData=load,
        cuModuleGetFunction=lambda module, name: (ok.CUDA_SUCCESS, 9),
        cuFuncGetAttribute=lambda attr, fn: (ok.CUDA_SUCCESS, 512))
    monkeypatch.setitem(sys.modules, "cuda", types.SimpleNamespace(bindings=types.SimpleNamespace(driver=driver)))
    monkeypatch.setitem(sys.modules, "cuda.bindings", types.SimpleNamespace(driver=driver))
    monkeypatch.setitem(sys.modules, "cuda.bindings.driver", driver)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)

    def zeros(*shape, device=None):
        calls.append(("zeros", str(device)))
        ctx[0] = 0x1234  # the primary context, made current by torch's first allocation
    monkeypatch.setattr(torch, "zeros", zeros)
    monkeypatch.setattr(kernels, "_driver_launch", lambda function: None)
    k = kernels.CudaKernel(b"image", "epg_kernel")
    assert calls == [("zeros", "cuda:0"), "load"]
    assert k._ctx == 0x1234 and k.max_threads == 512
    calls.clear()
    kernels.CudaKernel(b"image", "epg_kernel")  # a context current already: no allocation
    assert calls == ["load"]


def test_direct_call_takes_the_kernel_by_mode_and_world_size():
    """runtime.plan.direct_call: which dispatch_grouped calls take the direct kernel. Never where the op does not
    allow it, on the low-latency protocol, into a fresh layout or for a routing replay; "always" wherever allowed,
    "never" nowhere, "auto" up to DIRECT_AUTO_MAX_WORLD ranks (measured at one; the count tables' W x W reads past
    two are not); any other mode is refused with the modes named."""
    from runtime.plan import DIRECT_AUTO_MAX_WORLD, direct_call

    ok = dict(allowed=True, protocol="bw", fresh=False, replay=False)
    assert DIRECT_AUTO_MAX_WORLD == 2
    for world in (1, 2):
        assert direct_call("auto", world=world, **ok)
    for world in (3, 8, 64):
        assert not direct_call("auto", world=world, **ok)
        assert direct_call("always", world=world, **ok)
    for mode in ("auto", "always", "never"):
        assert not direct_call(mode, world=1, **{**ok, "allowed": False})
        assert not direct_call(mode, world=1, **{**ok, "protocol": "ll"})
        assert not direct_call(mode, world=1, **{**ok, "fresh": True})
        assert not direct_call(mode, world=1, **{**ok, "replay": True})
    assert not direct_call("never", world=1, **ok)
    for bad in ("Always", "", "on", None):
        with pytest.raises(InputError, match="must be one of auto, always, never"):
            direct_call(bad, world=1, **ok)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_low_latency_float_dispatch_gets_no_scales(mode):
    """templates/kernels/dispatch_ll.j2 renders a float payload's dispatch_ll / dispatch_ll_tail with no scale words
    (S = 0: its word paths have no byte loops), so a plan that launches one must give it no scales: they would be
    lost. Scales travel with a pre-quantized fp8 / fp4 payload, whose variants carry them."""
    if EpDispatchCombineConfig(**BASE, **MODES[mode]).ll_unavailable() is not None:
        return  # no low-latency kernels for this mode (its message says why)
    cfg = EpDispatchCombineConfig(**BASE, **MODES[mode], intranode_protocol="ll")
    plan = Plan.of(cfg, load_specs().targets["sm_90"])
    ll_roles = [name for role, name in plan.roles if role in ("dispatch_ll", "dispatch_ll_tail")]
    assert ll_roles, plan.roles
    for name in ll_roles:
        scaled = kernels.select("sm_90", name).dtype.kind != "float"
        assert (plan.scale_row > 0) == scaled, (name, plan.scale_row)
