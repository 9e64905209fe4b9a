"""scripts/ncu_table.py's reading of Nsight Compute's CSV exports (pure: no GPU, no ncu)."""

import csv
import gzip
import io
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.scripts import load_script


def _script():
    return load_script("ncu_table")


def _csv(rows) -> str:
    buf = io.StringIO()
    csv.writer(buf, quoting=csv.QUOTE_ALL).writerows(rows)
    return buf.getvalue()


def _raw(folder: Path, gz: bool) -> None:
    pre = "smsp__pcsamp_warps_issue_stalled_"
    head = ["ID", "Kernel Name", "gpu__time_duration.sum", pre + "no_instructions", pre + "imc_miss",
            pre + "barrier", pre + "no_instructions_not_issued"]
    units = ["", "", "nsecond", "inst", "warp", "warp", "inst"]
    rows = [head, units, ["0", "epg_dispatch_ll__bf16__intranode", "9,180", "30", "10", "60", "99"],
            ["1", "epg_combine_ll__bf16__intranode", "8,990", "0", "25", "75", "0"]]
    text = _csv(rows)
    if gz:
        (folder / "ncu_raw.csv.gz").write_bytes(gzip.compress(text.encode()))
    else:
        (folder / "ncu_raw.csv").write_text(text)


def test_reasons_are_shares_of_the_launch_samples_and_not_issued_counts_stay_out(tmp_path):
    mod = _script()
    _raw(tmp_path, gz=True)
    items = mod.launches(tmp_path)
    assert [i["kernel"] for i in items] == ["epg_dispatch_ll__bf16__intranode", "epg_combine_ll__bf16__intranode"]
    assert items[0]["us"] == pytest.approx(9.18)  # nanoseconds to µs
    assert items[0]["samples"] == {"no_instructions": 30.0, "imc_miss": 10.0, "barrier": 60.0}
    table = mod.reason_table(items)
    assert "| 0 | epg_dispatch_ll__bf16__intranode | 9.18 | 100 | 30% | 10% | 60% |" in table[2]
    assert "| 1 | epg_combine_ll__bf16__intranode | 8.99 | 100 | 0% | 25% | 75% |" in table[3]


def test_executed_stretches_join_small_gaps_and_split_at_jumps(tmp_path):
    mod = _script()
    head = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed", "stall_no_inst",
            "stall_imc", "stall_barrier", "stall_long_sb", "stall_wait"]
    executed = [1, 1, 0, 1, 0, 0, 0, 0, 1, 1]  # a gap of 1 (joined at gap 2), a jump over 4
    no_inst = [5, 0, 0, 0, 0, 0, 0, 0, 7, 0]
    rows = [["Kernel Name", "epg_k"], head]
    rows += [[f"0x{i:x}", f"NOP {i}", str(no_inst[i] + 1), str(executed[i] * 32), str(no_inst[i]), "0", "1", "0", "0"]
             for i in range(len(executed))]
    (tmp_path / "ncu_source.csv").write_text(_csv(rows))
    kernels = mod.source_kernels(tmp_path)
    assert len(kernels) == 1 and len(kernels[0]["rows"]) == 10
    runs = mod.stretches(kernels[0]["rows"], gap=2)
    assert [(r["first"], r["last"]) for r in runs] == [(0, 3), (8, 9)]
    assert [r["no_inst"] for r in runs] == [5, 7]
    assert [r["opens"] for r in runs] == ["NOP 0", "NOP 8"]
    table = mod.range_table(kernels[0], gap=2, min_samples=0)
    assert table[3].startswith("| 0 | 3 | 4 | 9 | 5 |") and table[3].endswith("| `NOP 0` |")
    assert [(r["first"], r["last"]) for r in mod.stretches(kernels[0]["rows"], gap=0)] == [(0, 1), (3, 3), (8, 9)]


def test_a_missing_or_broken_export_is_one_message(tmp_path, capsys):
    mod = _script()
    assert mod.main([str(tmp_path)]) == 2
    assert "no ncu_raw.csv" in capsys.readouterr().err
    (tmp_path / "ncu_raw.csv.gz").write_bytes(b"not gzip")
    assert mod.main([str(tmp_path)]) == 2
    assert "not a gzip file" in capsys.readouterr().err
    (tmp_path / "ncu_raw.csv.gz").unlink()
    (tmp_path / "ncu_raw.csv").write_text("a,b\n1,2\n3,4\n")
    assert mod.main([str(tmp_path)]) == 2
    assert "not an ncu raw page" in capsys.readouterr().err


def test_the_ncu_workload_refuses_bad_arguments_before_any_setup():
    """scripts/ncu_legs.py (run under ncu on the GPU machine) says what is wrong with its arguments in one line, before
    it starts a process group."""
    script = Path(__file__).resolve().parents[2] / "scripts" / "ncu_legs.py"
    for bad in (["--tokens", "0"], ["--calls", "0"], ["--protocol", "fast"]):
        proc = subprocess.run([sys.executable, str(script), *bad], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2, (bad, proc.stderr)
        assert "Traceback" not in proc.stderr and "error:" in proc.stderr, (bad, proc.stderr)
