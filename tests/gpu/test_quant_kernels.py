"""sm_90 (or the device's arch) quantize/dequantize kernels vs the reference encoders, bit for bit.

Run on a GPU machine: python -m pytest -m gpu tests/gpu/test_quant_kernels.py
"""


import pytest
import torch

from runtime import kernels, numerics

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a GPU", allow_module_level=True)

ARCH = kernels.device_arch(torch.device("cuda"))
FMT = "fnuz" if ARCH == "gfx942" else "ocp"
WIRE = "fp8_e4m3fnuz" if FMT == "fnuz" else "fp8_e4m3fn"
DT = {"bf16": torch.bfloat16, "fp32": torch.float32}
ROWS, HIDDEN = 64, 1024


def _inputs(dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(ROWS, HIDDEN, generator=g) * torch.exp2(torch.randint(-20, 20, (ROWS, 1), generator=g).float())
    flat = x.view(-1)
    specials = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-40, -3e-39, 448.0, 449.0,
                             480.0, -1e30, 240.0, 0.25, 0.75, 1.25, 2.5, 5.0, 6.0, 7.0, 2.0**-9, 2.0**-10])
    pos = torch.randint(0, flat.numel(), (4 * specials.numel(),), generator=g)
    flat[pos] = specials.repeat(4)
    x[3] = 0.0  # an all-zero row: zero scales / blocks
    return x.to(dtype)


def _launch(name, n, **tensors):
    """One launch with the family's declared arguments (specs/kernels.toml [args.quantize] / [args.dequantize])."""
    k = kernels.load(kernels.select(ARCH, name))
    k.launch(-(-n // 8 // 256), 256, **tensors, n_elems=n)
    torch.cuda.synchronize()
    k.close()


def _same_bits(a, b):
    """Equal bit patterns, NaN matching NaN (float outputs)."""
    if a.dtype.is_floating_point:
        nan = torch.isnan(a) & torch.isnan(b)
        return bool(((a.view(torch.int16 if a.element_size() == 2 else torch.int32)
                      == b.view(torch.int16 if b.element_size() == 2 else torch.int32)) | nan).all())
    return bool((a == b).all())


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("mode", ["fp8_direct_cast", "fp8_blockwise"])
def test_fp8_quantize_bit_exact(dtype, mode):
    x = _inputs(DT[dtype], 1).cuda()
    q = torch.full((ROWS, HIDDEN), 0xA5, dtype=torch.uint8, device="cuda")
    s = torch.full((ROWS, HIDDEN // 128), -7.0, device="cuda")
    _launch(f"quantize_fp8.{dtype}.{WIRE}.{mode}", x.numel(), x=x, q=q, scales=s)
    rq, rs = numerics.quantize_fp8(x.cpu(), FMT, mode)
    assert torch.equal(q.cpu(), rq), f"{(q.cpu() != rq).sum()} bytes differ"
    if rs is not None:
        assert _same_bits(s.cpu(), rs)
    # dequantize back, against the reference
    for out in ("bf16", "fp32"):
        y = torch.empty(ROWS, HIDDEN, dtype=DT[out], device="cuda")
        _launch(f"dequantize_fp8.{out}.{WIRE}.{mode}", x.numel(), q=q, scales=s, y=y)
        ry = numerics.dequantize_fp8(rq, rs, FMT, mode, DT[out])
        assert _same_bits(y.cpu(), ry)


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_fp4_quantize_bit_exact(dtype):
    if ARCH == "gfx942":
        pytest.skip("gfx942 has no FP4 conversion variant (rule fp4_conversion_target)")
    x = _inputs(DT[dtype], 2).cuda()
    q = torch.full((ROWS, HIDDEN // 2), 0xA5, dtype=torch.uint8, device="cuda")
    s = torch.full((ROWS, HIDDEN // 32), 0x5A, dtype=torch.uint8, device="cuda")
    _launch(f"quantize_fp4.{dtype}.fp4_e2m1.fp4_blockwise", x.numel(), x=x, q=q, scales=s)
    rq, rs = numerics.quantize_fp4(x.cpu())
    assert torch.equal(s.cpu(), rs), f"{(s.cpu() != rs).sum()} scale bytes differ"
    diff = (q.cpu() != rq).nonzero().tolist()
    detail = [(r, c, x.cpu()[r, 2 * c:2 * c + 2].float().tolist(), int(rs[r, 2 * c // 32]), int(q.cpu()[r, c]), int(rq[r, c]))
              for r, c in diff[:6]]
    assert not diff, f"{len(diff)} bytes differ (row, byte, inputs, scale byte, got, want): {detail}"
    for out in ("bf16", "fp32"):
        y = torch.empty(ROWS, HIDDEN, dtype=DT[out], device="cuda")
        _launch(f"dequantize_fp4.{out}.fp4_e2m1.fp4_blockwise", x.numel(), q=q, scales=s, y=y)
        assert _same_bits(y.cpu(), numerics.dequantize_fp4(rq, rs, DT[out]))
