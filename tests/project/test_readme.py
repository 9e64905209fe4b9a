"""The README as a newcomer uses it: each python block (the usage example, the grouped-GEMM MoE layer) is a complete
script, run as written under torchrun (2 CPU ranks on gloo here; tests/gpu/test_readme_gpu.py: GPUs on NCCL), its
install lines and first command say what they need, and its performance tables are what scripts/layer_table.py makes
of the committed records they cite."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.support.readme import README, ROOT, rank_reports, run_script, run_usage, scripts, usage_block


def test_usage_block_is_a_complete_script_on_the_public_api():
    code = usage_block()
    assert "from runtime import EpDispatchCombineConfig, EpDispatchCombineOp" in code
    assert all(call in code for call in ("op.dispatch(", "op.combine(", "dist.init_process_group(",
                                         "dist.destroy_process_group()"))
    # NCCL after the device is selected (docs/INTERNODE.md says the same)
    assert code.index("torch.cuda.set_device(") < code.index('init_process_group("nccl"')
    compile(code, "README.md (usage)", "exec")


def test_usage_block_runs_verbatim_under_torchrun_on_cpu(tmp_path):
    out = run_usage(tmp_path, env={"CUDA_VISIBLE_DEVICES": ""})
    lines = rank_reports(out)
    assert [line.split(":")[0] for line in lines] == ["rank 0", "rank 1"], out
    for line in lines:
        received = int(re.search(r"received (\d+) rows", line).group(1))
        assert 128 <= received <= 256  # every token reaches at least one rank, each rank at most once


def test_every_python_block_runs_verbatim_under_torchrun_on_cpu(tmp_path):
    """The blocks after the usage one (the grouped-GEMM MoE layer): each a complete script on the public API that
    checks itself (the layer against its dense computation) and prints one line per rank."""
    rest = scripts()[1:]
    assert [name for name, _ in rest] == ["moe_example.py"]
    for name, code in rest:
        assert "from runtime import EpDispatchCombineConfig, EpDispatchCombineOp" in code
        out = run_script(tmp_path, name, code, env={"CUDA_VISIBLE_DEVICES": ""})
        lines = rank_reports(out)
        assert [line.split(":")[0] for line in lines] == ["rank 0", "rank 1"], out
    code = dict(rest)["moe_example.py"]
    assert "enable_grouped_layout=True" in code and all(
        f"op.{call}(" in code for call in ("dispatch_grouped", "combine_grouped"))
    distances = [float(re.search(r"relative distance from the dense layer ([0-9.eE+-]+)", line).group(1)) for line in lines]
    assert all(d < 2e-2 for d in distances), out


def _perf_section() -> str:
    text = README.read_text()
    return text[text.index("## Performance"):text.index("\n## ", text.index("## Performance") + 1)]


def test_performance_tables_are_the_committed_records():
    section = _perf_section()
    m = re.search(r"`python (scripts/layer_table\.py) (results/\S+\.jsonl)`", section)
    assert m, "the performance section names the command that makes its tables"
    assert (ROOT / m.group(2)).is_file(), f"{m.group(2)} is not committed"
    r = subprocess.run([sys.executable, m.group(1), m.group(2)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    made = set(r.stdout.splitlines())
    rows = [line for line in section.splitlines() if line.startswith("|")]
    assert len(rows) >= 20, "the layer loop and MoE layer tables"
    assert [row for row in rows if row not in made] == [], "README tables differ from scripts/layer_table.py's"
    commit = re.search(r"\(commit (\w+);", r.stdout).group(1)
    assert f"commit {commit}" in section and f"-{commit}/" in section  # the commit named, its records' folder


def test_the_wheel_line_installs_what_the_runtime_needs():
    """The README's wheel path ends with the runtime usable: the wheel installed with its [runtime] extra (torch,
    numpy), as scripts/wheel_check.sh installs it."""
    text = README.read_text()
    line = next(line for line in text.splitlines() if line.startswith("pip wheel "))
    install = line.split("&&")[1].split("#")[0].strip()
    assert install == 'pip install "$(ls dist/epgen-*.whl)[runtime]"', install
    assert '"$whl[runtime]"' in (ROOT / "scripts" / "wheel_check.sh").read_text()


def test_command_one_says_what_it_needs_and_what_to_do_otherwise():
    """README command 1 runs apt-get: one comment line says it needs root and an apt source with the clang it names,
    and what to do without them (the clang the AMD toolchain accepts, per specs/targets.toml)."""
    from generator import specs as gspecs

    block = re.search(r"^```bash\n(.*?)^```$", README.read_text(), flags=re.S | re.M).group(1).splitlines()
    command = next(i for i, line in enumerate(block) if line.startswith("apt-get "))
    note = block[command - 1]
    clang = re.search(r"install -y -q --no-install-recommends (clang-\d+) ", block[command]).group(1)
    assert note.startswith("# needs root and an apt source with ") and f" {clang} " in note, note
    amd = gspecs.load().toolchains["amd"]
    assert f"else install clang ≥ {amd.min_clang} + llvm-objdump (or ROCm) and run the two python3 commands" in note
    assert block[command].count("python3 ") == 2
