"""The GPUs of this host, as nvidia-smi lists them: which there are, which processes hold
them, and what their health counters, the kernel log and a small matmul say.

The one place this package runs nvidia-smi. Facts only: the verdicts are the controller's
(`fdl_fabric.preflight.gpus`), so the raw outputs travel as they were printed and every
parser and every wording lives there. Standard library only, Python 3.8 syntax: it runs
inside the agent. Every command is bounded (`GPU_TIMEOUT`, `MATMUL_TIMEOUT`), killed
with its process group past the bound, and calls ``beat`` while it runs, so a broken
driver that hangs nvidia-smi costs a bounded wait and never silences the agent.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from fdl_fabric.agent import bounded

#: Seconds each nvidia-smi query gets (it can hang on a broken driver).
GPU_TIMEOUT = 10.0
#: Seconds the kernel-log read gets.
LOG_TIMEOUT = 5.0
#: Seconds the matmul program gets at most: importing torch and starting CUDA take a few.
MATMUL_TIMEOUT = 40.0
#: Seconds the whole GPU gathering may take: the launcher waits a minute for an agent's
#: facts, and the other checks need some of it. The matmul gets what is left.
GATHER_BUDGET = 50.0
#: The least time worth starting the matmul with.
MATMUL_MIN = 5.0
#: The most output kept of one command (an 8-GPU ``-q`` is about 60 KB).
OUTPUT_MAX = 256 * 1024
#: The kernel-log lines kept: the last ones naming an Xid.
XID_LINES_MAX = 50

#: The ``--query-gpu`` fields of the health query. Printed with a header (``--format=csv``),
#: so the controller reads them by name. Fields that nvidia-smi has known for a decade:
#: an unknown field makes the whole query fail, so the counters come from ``-q``.
HEALTH_FIELDS = ("index,pci.bus_id,uuid,name,pstate,temperature.gpu,power.draw,"
                 "memory.used,memory.total,utilization.gpu")
#: The ``-q`` sections the health verdicts read (short: four sections, not the whole log).
HEALTH_DISPLAY = "ECC,PAGE_RETIREMENT,ROW_REMAPPER,PERFORMANCE"
#: The compute processes, with the memory each holds.
APPS_QUERY = "--query-compute-apps=gpu_uuid,pid,used_memory"
#: What a kernel-log line of a GPU fault contains (``NVRM: Xid (PCI:0000:9b:00): 119, ...``).
XID_MARK = "NVRM: Xid"

Beat = Callable[[float], None]


def run_bounded(argv: List[str], timeout: float, beat: Optional[Beat] = None,
                cwd: Optional[str] = None,
                env: Optional[Dict[str, str]] = None) -> Tuple[str, str]:
    """``(status, output)`` of one command, stdout and stderr together: status is the exit
    status as text, ``missing`` when the program is not there, ``error`` when it could
    not start or did not end within ``timeout`` (then killed with its process group, and
    the output says why). ``beat`` is called every `bounded.BEAT_EVERY` seconds meanwhile."""
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                cwd=cwd, env=env)
    except FileNotFoundError as exc:
        return "missing", str(exc)
    except OSError as exc:
        return "error", str(exc)
    done = bounded.communicate(proc, timeout, beat)
    if done is None:
        return "error", f"{argv[0]} gave no answer within {timeout:g} s (killed)"
    out = done[0]
    return str(proc.returncode), out[:OUTPUT_MAX].decode("utf-8", "replace")


def _smi(args: List[str], beat: Optional[Beat] = None) -> Tuple[str, str]:
    return run_bounded(["nvidia-smi"] + args, GPU_TIMEOUT, beat)


def nvidia_smi(query: str, beat: Optional[Beat] = None) -> Tuple[str, str]:
    """``(status, output)`` of one ``nvidia-smi <query> --format=csv,noheader``, stderr
    included: status is the exit status as text, ``missing`` when there is no nvidia-smi
    on PATH, ``error`` when it could not run or gave no answer within `GPU_TIMEOUT` (the
    output then says why). The one way this package runs a CSV query."""
    return _smi([query, "--format=csv,noheader"], beat)


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


def gpu_listing(beat: Optional[Beat] = None) -> Dict[str, str]:
    """What prebuild-check judges of the GPUs: ``gpu_rc`` (nvidia-smi's status, or
    ``missing``), ``gpus`` (``index, uuid`` lines) and ``gpu_apps`` (the compute processes
    as ``gpu_uuid, pid, used memory`` lines), lines joined with ``;``. UUIDs, because
    nvidia-smi names a compute process's GPU by UUID while ``local_devices`` names GPUs by
    index."""
    status, text = nvidia_smi("--query-gpu=index,uuid", beat)
    if status == "missing":
        return {"gpu_rc": "missing"}
    values = {"gpu_rc": status, "gpus": _joined(text)}
    values["gpu_apps"] = _apps(beat)
    return values


def _apps(beat: Optional[Beat]) -> str:
    status, apps = nvidia_smi(APPS_QUERY, beat)
    return _joined(apps) if status == "0" else ""


def _joined(text: str) -> str:
    return "".join(line + ";" for line in text.strip().splitlines())


def gpu_health(beat: Optional[Beat] = None) -> Dict[str, str]:
    """The raw health facts: ``gpu_health_rc`` and ``gpu_health_csv`` (the `HEALTH_FIELDS`
    query, with its header), ``gpu_q_rc`` and ``gpu_q`` (``nvidia-smi -q`` of the
    `HEALTH_DISPLAY` sections; the whole ``-q`` where this driver refuses a section name),
    ``gpu_table`` (plain ``nvidia-smi``: where a GPU that has crashed shows ``ERR!`` while
    nvidia-smi still exits 0). Only ``gpu_health_rc`` when there is no nvidia-smi."""
    status, csv = _smi(["--query-gpu=" + HEALTH_FIELDS, "--format=csv"], beat)
    if status == "missing":
        return {"gpu_health_rc": "missing"}
    values = {"gpu_health_rc": status, "gpu_health_csv": csv}
    q_status, q = _smi(["-q", "-d", HEALTH_DISPLAY], beat)
    if q_status not in ("0", "error"):
        q_status, q = _smi(["-q"], beat)
    values.update({"gpu_q_rc": q_status, "gpu_q": q})
    _, values["gpu_table"] = _smi([], beat)
    return values


def kernel_xids(beat: Optional[Beat] = None) -> Dict[str, str]:
    """``gpu_xid``: the last kernel-log lines naming an Xid (the driver's GPU fault
    reports), or ``gpu_xid_error``: why ``dmesg`` could not read the log (it is refused
    to users other than root where ``kernel.dmesg_restrict`` is set: ``dmesg: read kernel
    buffer failed: Operation not permitted``). No other source is tried: ``journalctl``
    may answer an unprivileged user with an empty log and exit 0, which would read as
    "no Xid"."""
    status, text = run_bounded(["dmesg"], LOG_TIMEOUT, beat)
    if status == "0":
        lines = [ln.strip() for ln in text.splitlines() if XID_MARK in ln]
        return {"gpu_xid": "\n".join(lines[-XID_LINES_MAX:])}
    first = (text.strip().splitlines() or [f"status {status}"])[0]
    return {"gpu_xid_error": f"dmesg: {first[:160]}" if not first.startswith("dmesg") else
            first[:160]}


#: The matmul program, run by the ranks' interpreter with ``-c``; argv[1] is the JSON list
#: of GPU indices (or ``"all"``). A fixed seeded pair of 256x256 float32 matrices is
#: multiplied on each GPU and compared with the CPU's product (``allclose``, relative and
#: absolute tolerance 1e-3; TF32 off, so the GPU computes in full float32). It prints one
#: JSON line, last: ``{"skip": why}`` without torch or CUDA, else ``{"torch": version,
#: "results": {index: {"ok": bool, "max_diff": float} | {"error": text}}}``. GPU indices
#: are nvidia-smi's (``CUDA_DEVICE_ORDER=PCI_BUS_ID``); where ``CUDA_VISIBLE_DEVICES``
#: is already set (a Slurm step) an index is looked up in it. Any Python 3.
MATMUL_SCRIPT = r"""
import json, os, sys
asked = json.loads(sys.argv[1])
out = {}
try:
    import torch
except Exception as exc:
    out["skip"] = "torch is not importable (%s: %s)" % (type(exc).__name__, exc)
else:
    out["torch"] = torch.__version__
    if not torch.cuda.is_available():
        out["skip"] = "CUDA is not available to torch %s" % torch.__version__
    else:
        torch.backends.cuda.matmul.allow_tf32 = False
        visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
                   if v.strip()]
        if asked == "all":
            asked = [int(v) for v in visible] if visible and all(v.isdigit() for v in visible) \
                else list(range(torch.cuda.device_count()))
        gen = torch.Generator().manual_seed(20240)
        a = torch.rand(256, 256, generator=gen)
        b = torch.rand(256, 256, generator=gen)
        want = a @ b
        results = {}
        for index in asked:
            try:
                ordinal = visible.index(str(index)) if visible else int(index)
                dev = torch.device("cuda", ordinal)
                got = (a.to(dev) @ b.to(dev)).cpu()
                diff = float((got - want).abs().max())
                ok = bool(torch.allclose(got, want, rtol=1e-3, atol=1e-3))
                results[str(index)] = {"ok": ok, "max_diff": diff}
            except Exception as exc:
                results[str(index)] = {"error": "%s: %s" % (type(exc).__name__, exc)}
        out["results"] = results
sys.stdout.write("\n" + json.dumps(out) + "\n")
"""


def matmul(python: str, devices: Any, cwd: str, python_path: Optional[str], timeout: float,
           beat: Optional[Beat] = None, path_env: Optional[str] = None) -> str:
    """``gpu_matmul``: the matmul program's JSON line, or ``skip:why`` (the interpreter
    cannot be started: the program row says why), ``timeout:why`` (it did not finish
    within ``timeout``: a hung GPU, or only a slow import of torch) or ``error:why`` (it
    crashed)."""
    env = dict(os.environ)
    env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    if python_path is not None:
        env["PYTHONPATH"] = python_path
    if path_env is not None:  # the ranks' PATH, where cluster.yml sets one: found as they are
        env["PATH"] = path_env
    folder = os.path.expanduser(cwd)
    status, out = run_bounded([python, "-c", MATMUL_SCRIPT, json.dumps(devices)], timeout,
                              beat, cwd=folder if os.path.isdir(folder) else None, env=env)
    return _matmul_answer(python, status, out)


def _matmul_answer(python: str, status: str, out: str) -> str:
    """`matmul`'s value from how the program ended and what it printed."""
    lines = [ln.strip() for ln in out.splitlines() if ln.strip()]
    if status == "missing":
        return f"skip:interpreter {python} not found"
    if status == "0" and lines and lines[-1].startswith("{"):
        return lines[-1]
    if status == "error" and lines and "gave no answer" in lines[-1]:
        return f"timeout:{lines[-1]}"
    last = lines[-1][:200] if lines else ""
    how = last if status == "error" else f"exited {status}" + (f": {last}" if last else "")
    return f"error:{how}"


def gather(wanted: Dict[str, Any], cwd: str, beat: Callable[[float], None]) -> Dict[str, str]:
    """What the pre-flight asks of the GPUs (``wanted``, `fdl_fabric.preflight.probe.
    agent_checks`): ``listing`` (`gpu_listing`), ``health`` (`gpu_health`, the compute
    processes and `kernel_xids`) and ``matmul`` (a product on each GPU against the CPU's,
    with ``python``, ``python_path`` and, when given, the ranks' ``path_env``, within what
    is left of `GATHER_BUDGET`). Raw values only;
    `fdl_fabric.preflight.gpus` judges them."""
    started = time.monotonic()
    values: Dict[str, str] = {}
    if wanted.get("listing"):
        values.update(gpu_listing(beat))
    if wanted.get("health"):
        values.update(gpu_health(beat))
    absent = "missing" in (values.get("gpu_rc"), values.get("gpu_health_rc"))
    if wanted.get("health") and not absent:
        if "gpu_apps" not in values:
            values["gpu_apps"] = _apps(beat)
        values.update(kernel_xids(beat))
    if wanted.get("matmul"):
        values["gpu_matmul"] = "skip:there is no nvidia-smi on this host" if absent else \
            _matmul_value(wanted, cwd, beat, started)
    return values


def _matmul_value(wanted: Dict[str, Any], cwd: str, beat: Beat, started: float) -> str:
    python = wanted.get("python")
    if not python:
        return "skip:the ranks' command does not start with a Python interpreter"
    left = min(MATMUL_TIMEOUT, GATHER_BUDGET - (time.monotonic() - started))
    if left < MATMUL_MIN:
        return "skip:no time left for it within the pre-flight's bound"
    return matmul(str(python), wanted.get("devices", "all"), cwd, wanted.get("python_path"),
                  left, beat, wanted.get("path_env"))
