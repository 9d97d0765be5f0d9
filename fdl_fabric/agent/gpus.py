"""The GPUs of this host, as nvidia-smi lists them: which there are, which processes hold
them, and (`gather_health`) what their health counters say.

The one place this package runs nvidia-smi. Facts only: the verdicts are the controller's
(`fdl_fabric.preflight.gpus`). Standard library only: it runs inside the agent.
"""

from __future__ import annotations

import os
import subprocess
from typing import Any, Callable, Dict, Tuple

#: Seconds each nvidia-smi query gets (it can hang on a broken driver).
GPU_TIMEOUT = 10.0


def nvidia_smi(query: str) -> Tuple[str, str]:
    """``(status, output)`` of one ``nvidia-smi <query> --format=csv,noheader``, stderr
    included: status is the exit status as text, ``missing`` when there is no nvidia-smi
    on PATH, ``error`` when it could not run or gave no answer within `GPU_TIMEOUT` (the
    output then says why). The one way this package runs nvidia-smi."""
    try:
        proc = subprocess.run(["nvidia-smi", query, "--format=csv,noheader"],
                              stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, timeout=GPU_TIMEOUT, check=False)
    except FileNotFoundError as exc:
        return "missing", str(exc)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return "error", str(exc)
    return str(proc.returncode), proc.stdout.decode("utf-8", "replace")


def gpu_indices() -> Dict[str, Any]:
    """``{"gpus": [0, 1, ...]}`` from nvidia-smi, or ``{"gpus": None, "gpu_error": why}``.

    The GPU indices of this host: agents answer `local_devices: all` with it, and the
    launcher uses it for its own machine (dry runs, ``fdl-fabric run --nproc-per-node gpu``).
    Inside a Slurm step the answer is the step's own GPUs (CUDA_VISIBLE_DEVICES, as Slurm
    set it): nvidia-smi may list GPUs that belong to other jobs.
    """
    if os.environ.get("SLURM_STEP_ID") is not None:
        listed = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
        if all(x.strip().isdigit() for x in listed):
            return {"gpus": [int(x) for x in listed]}
        return {"gpus": None, "gpu_error": "this Slurm step holds no GPU: ask the job for "
                "them (--gpus-per-node=N or --gres=gpu:N)"}
    status, text = nvidia_smi("--query-gpu=index")
    if status in ("missing", "error"):
        return {"gpus": None, "gpu_error": text}
    found = [int(x) for x in text.split() if x.strip().isdigit()]
    if status != "0" or not found:
        return {"gpus": None, "gpu_error": text.strip()[:200] or f"status {status}"}
    return {"gpus": found}


def gpu_listing() -> Dict[str, str]:
    """What prebuild-check judges of the GPUs: ``gpu_rc`` (nvidia-smi's status, or
    ``missing``), ``gpus`` (``index, uuid`` lines) and ``gpu_apps`` (the compute processes
    as ``gpu_uuid, pid`` lines), lines joined with ``;``. UUIDs, because nvidia-smi names a
    compute process's GPU by UUID while ``local_devices`` names GPUs by index."""
    status, text = nvidia_smi("--query-gpu=index,uuid")
    if status == "missing":
        return {"gpu_rc": "missing"}
    values = {"gpu_rc": status, "gpus": _joined(text)}
    apps_status, apps = nvidia_smi("--query-compute-apps=gpu_uuid,pid")
    values["gpu_apps"] = _joined(apps) if apps_status == "0" else ""
    return values


def _joined(text: str) -> str:
    return "".join(line + ";" for line in text.strip().splitlines())


def gather(wanted: Dict[str, Any], cwd: str, beat: Callable[[float], None]) -> Dict[str, str]:
    """What the pre-flight asks of the GPUs (``wanted``, `fdl_fabric.preflight.probe.
    agent_checks`): ``listing`` (`gpu_listing`), ``health`` (the health counters) and
    ``matmul`` (a product on each GPU against the CPU's, with ``python``). Raw values
    only; `fdl_fabric.preflight.gpus` judges them."""
    values: Dict[str, str] = {}
    if wanted.get("listing"):
        values.update(gpu_listing())
    return values
