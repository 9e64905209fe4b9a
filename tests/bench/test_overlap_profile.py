"""scripts/overlap_profile.py's reading of a kernel timeline (pure: no GPU)."""

from tests.support.scripts import load_script


def _script():
    return load_script("overlap_profile")


def test_epgen_kernels_running_beside_the_gemm_are_counted():
    m = _script()
    gemm = ("nvjet_hsh_256x128", 100.0, 50.0)  # runs 100..150 µs
    events = [("epg_dispatch_ll__bf16__intranode", 90.0, 5.0),   # the send half, done before the GEMM starts
              gemm,
              ("epg_dispatch_ll__bf16__intranode", 151.0, 4.0)]  # the receive half, after it
    assert m.overlapping(gemm, events) == 0
    spinning = [("epg_dispatch__bf16__intranode", 95.0, 40.0)]     # a send kernel still resident when the GEMM runs
    assert m.overlapping(gemm, events + spinning) == 1
    late = [("epg_combine_ll__bf16__intranode", 149.0, 3.0)]       # a receive half started before the GEMM ended
    assert m.overlapping(gemm, events + spinning + late) == 2
    assert m.overlapping(gemm, [("other_kernel", 120.0, 5.0)]) == 0  # not epgen's
