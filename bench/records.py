"""Benchmark records: the metadata every record carries (``meta``: commit, date, device, driver, torch, world
size; ``device_info``), and records as JSON lines (``write_records``, ``read_records``)."""

from __future__ import annotations

import json
import os
import subprocess
import time

import torch
import torch.distributed as dist


def commit() -> str:
    """EPGEN_COMMIT when set (a copied working tree may carry stale git metadata), else git's HEAD,
    marked "+dirty" when tracked files differ from it."""
    if os.environ.get("EPGEN_COMMIT"):
        return os.environ["EPGEN_COMMIT"]
    try:
        git = lambda *a: subprocess.run(["git", *a], capture_output=True, text=True, timeout=10)  # noqa: E731
        rev = git("rev-parse", "--short", "HEAD").stdout.strip()
        if rev and git("status", "--porcelain", "--untracked-files=no").stdout.strip():
            rev += "+dirty"
    except (OSError, subprocess.SubprocessError):
        rev = ""
    return rev


def device_info(device) -> dict:
    """The device fields of a record: gpu, driver (nvidia-smi), cuda_driver_api, sms, target ("cpu" off a GPU)."""
    device = torch.device(device)
    if device.type != "cuda":
        return {"gpu": "cpu", "driver": "", "cuda_driver_api": None, "sms": None, "target": "cpu"}
    driver = ""
    try:
        res = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        driver = (res.stdout.strip().splitlines() or [""])[0].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        api = int(torch._C._cuda_getDriverVersion())
    except Exception:  # noqa: BLE001 - metadata only
        api = None
    props = torch.cuda.get_device_properties(device)
    return {"gpu": props.name, "driver": driver, "cuda_driver_api": api, "sms": props.multi_processor_count,
            "target": op_arch()}


def op_arch() -> str:
    """This process's GPU target (runtime.kernels.device_arch)."""
    from runtime.kernels import device_arch
    return device_arch(torch.device("cuda"))


def meta(dev, **kw) -> dict:
    """The metadata of a record made on `dev`: commit, date, device_info's fields, torch, world_size (1 in a process
    with no group), whether the eager calls took the steady path (EPGEN_STEADY_PATH), the target's spin_polls as the
    specs say (the EP kernels' back-to-back polls before pausing: a build fact an A/B changes), whether its kernels
    were launched with programmatic stream serialization (the specs' fact and EPGEN_PROGRAMMATIC_LAUNCH), and `kw`."""
    from runtime.config import load_specs
    from runtime.kernels import programmatic_launch
    from runtime.op import steady_path_enabled

    info = device_info(dev)
    spec = load_specs().targets.get(info["target"])
    return {"commit": commit(), "date": time.strftime("%Y-%m-%d", time.gmtime()), "gpu": info["gpu"],
            "driver": info["driver"], "cuda_driver_api": info["cuda_driver_api"], "target": info["target"],
            "sms": info["sms"], "torch": torch.__version__,
            "world_size": dist.get_world_size() if dist.is_initialized() else 1,
            "steady_path": steady_path_enabled(), "spin_polls": spec.spin_polls if spec is not None else None,
            "programmatic_launch": programmatic_launch(spec) if spec is not None else None, **kw}


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, None where either is missing (or b is 0)."""
    return a / b if a is not None and b else None


def read_records(path) -> list[dict]:
    """The benchmark records of a JSON-lines file (blank lines skipped)."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def write_records(path, records: list[dict]) -> None:
    """Append records to the JSON-lines file at `path` (keys sorted, one line each)."""
    with open(path, "a") as f:
        for r in records:
            f.write(json.dumps(r, sort_keys=True) + "\n")


def emit_point(rec: dict, lines: list[str], out) -> None:
    """A profiling script's point on rank 0: its table printed, its record appended to `out` (jsonl; None: not
    kept). Other ranks print and write nothing."""
    if dist.get_rank() != 0:
        return
    print("\n".join(lines), flush=True)
    if out:
        with open(out, "a") as f:
            f.write(json.dumps(rec) + "\n")
