"""The fast pre-flight on this host: facts only, gathered before any rank starts.

What a launch relies on and can fail half-way without: the working directory, the
program (resolved the way ``execvpe`` will), a ``python3 train.py`` script, free disk,
and whether this host reaches *this* run's coordinator. The agent reports raw values
under the names `fdl_fabric.preflight` judges (``path``, ``prog``, ``dial``...), so
every verdict and its wording live in one place, on the controller.

The coordinator check sends an authenticated ``probe`` frame (the run's salt keys it)
and checks the authenticated reply, so a different service on that port, or another
run's coordinator, is told apart from ours.
"""

from __future__ import annotations

import os
import socket
import subprocess
from typing import Any, Callable, Dict, Optional

from fdl_fabric import rank

DIAL_TIMEOUT = 3.0
#: The ``dial`` value when the coordinator answered with this run's key.
DIAL_OK = "ok"


def dir_state(path: str) -> str:
    """ok, missing, notdir or unreadable: what a rank's ``chdir`` would run into."""
    if os.path.isdir(path):
        return "ok" if os.access(path, os.R_OK | os.X_OK) else "unreadable"
    return "notdir" if os.path.exists(path) else "missing"


def _is_exe(path: str) -> str:
    if os.path.isfile(path) and os.access(path, os.X_OK):
        return path
    return "!noexec" if os.path.exists(path) else "!missing"


def resolve_program(program: str, cwd: str, path_env: Optional[str]) -> str:
    """The file ``execvpe`` would run, or ``!missing``/``!noexec``/``!nocwd``."""
    cwd_ok = os.path.isdir(cwd)
    if program.startswith("/"):
        return _is_exe(program)
    if "/" in program:
        return _is_exe(os.path.join(cwd, program)) if cwd_ok else "!nocwd"
    search = path_env if path_env is not None else os.environ.get("PATH", os.defpath)
    for folder in search.split(os.pathsep):
        folder = folder or "."
        candidate = os.path.join(folder if os.path.isabs(folder) else os.path.join(cwd, folder),
                                 program)
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return "!missing"


def dial(host: str, port: int, salt: bytes, run_id: str, me: str) -> str:
    """``ok`` when this run's coordinator answers; ``!reason`` when it cannot be reached."""
    import time

    deadline = time.monotonic() + DIAL_TIMEOUT  # connect and reply together
    try:
        sock = socket.create_connection((host, port), timeout=DIAL_TIMEOUT)
    except OSError as exc:
        return "!" + (exc.strerror or str(exc) or type(exc).__name__)
    try:
        sock.settimeout(max(0.1, deadline - time.monotonic()))
        sock.sendall(rank.encode_frame(salt, run_id, 0, {"type": "probe", "host": me}))
        buf = bytearray()
        reply = rank.receive(sock, buf, salt, run_id, 0)
    except socket.timeout:
        return f"?no answer within {DIAL_TIMEOUT:g} s"
    except rank.FrameError as exc:
        return f"?{exc}"
    except OSError as exc:
        return "!" + (exc.strerror or str(exc))
    finally:
        sock.close()
    if reply is None:
        return "?closed without a reply"
    return DIAL_OK if reply.get("type") == "probe_ok" else f"?{reply.get('type')}"


#: How long the MASTER_ADDR check waits for the name and for the host to answer.
REACH_TIMEOUT = 2.0


def reach(host: str, port: int) -> str:
    """Whether this host's ranks can dial ``host:port`` (MASTER_ADDR) before rank 0 listens
    there: ``ok <ip>`` when the host answered (a refusal is an answer: rank 0 is not up
    yet), ``busy <ip>`` when something already listens, ``!why`` when the name does not
    resolve or the host does not answer within `REACH_TIMEOUT`."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        return f"!does not resolve here ({exc.strerror or exc})"
    except (OSError, UnicodeError) as exc:
        return f"!does not resolve here ({exc})"
    why = "no address"
    for family, kind, proto, _, sockaddr in infos:
        with socket.socket(family, kind, proto) as sock:
            sock.settimeout(REACH_TIMEOUT)
            try:
                sock.connect(sockaddr)
            except ConnectionRefusedError:
                return f"ok {sockaddr[0]}"
            except socket.timeout:
                why = f"{sockaddr[0]} gave no answer within {REACH_TIMEOUT:g} s"
                continue
            except OSError as exc:
                why = f"{sockaddr[0]}: {exc.strerror or exc}"
                continue
            return f"busy {sockaddr[0]}"
    return f"!{why}"


def gpu_indices() -> Dict[str, Any]:
    """``{"gpus": [0, 1, ...]}`` from nvidia-smi, or ``{"gpus": None, "gpu_error": why}``.

    The one GPU query of the package: agents answer `local_devices: all` with it, and the
    launcher uses it for its own machine (dry runs, ``fdl-fabric run --nproc-per-node gpu``).
    Inside a Slurm step the answer is the step's own GPUs (CUDA_VISIBLE_DEVICES, as Slurm
    set it): nvidia-smi may list GPUs that belong to other jobs.
    """
    import subprocess

    if os.environ.get("SLURM_STEP_ID") is not None:
        listed = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
        if all(x.strip().isdigit() for x in listed):
            return {"gpus": [int(x) for x in listed]}
        return {"gpus": None, "gpu_error": "this Slurm step holds no GPU: ask the job for "
                "them (--gpus-per-node=N or --gres=gpu:N)"}

    try:
        proc = subprocess.run(["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=10,
                              check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"gpus": None, "gpu_error": str(exc)}
    text = proc.stdout.decode("utf-8", "replace")
    found = [int(x) for x in text.split() if x.strip().isdigit()]
    if proc.returncode != 0 or not found:
        return {"gpus": None, "gpu_error": text.strip()[:200] or f"status {proc.returncode}"}
    return {"gpus": found}


#: How long the interpreter may take to find a module (it imports the module's parents);
#: beyond it the module is not checked. Well under the agent's heartbeat deadline.
MODULE_CHECK_TIMEOUT = 5.0


def find_module(python: str, module: str, cwd: str, python_path: Optional[str] = None) -> str:
    """``ok``, ``missing``, or ``unknown`` (the check itself failed or took too long): the
    module as ``python -m`` will look for it, from the rank's working directory, with the
    PYTHONPATH the cluster file gives its ranks (else this agent's own)."""
    env = dict(os.environ)
    if python_path is not None:
        env["PYTHONPATH"] = python_path
    code = ("import importlib.util, sys\n"
            "try:\n    found = importlib.util.find_spec(sys.argv[1]) is not None\n"
            "except (ImportError, ValueError):\n    found = False\n"
            "sys.exit(0 if found else 3)")
    try:
        done = subprocess.run([python, "-c", code, module],
                              cwd=cwd if os.path.isdir(cwd) else None, env=env,
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, timeout=MODULE_CHECK_TIMEOUT)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return {0: "ok", 3: "missing"}.get(done.returncode, "unknown")


def gather(checks: Dict[str, Any], salt: bytes, run_id: str, host: str,
           beat: Optional[Callable[[float], None]] = None) -> Dict[str, str]:
    """Every fact the spec asks for, as ``name -> value`` strings. ``beat`` keeps the
    agent heard by its launcher before the one step that may wait (the dial)."""
    values: Dict[str, str] = {}
    path = os.path.expanduser(str(checks["path"]))
    values["path"] = dir_state(path)
    try:
        st = os.statvfs(path)
        values["disk_kb"] = str(st.f_bavail * st.f_frsize // 1024)
    except OSError:
        values["disk_kb"] = ""
    cwd = os.path.expanduser(str(checks.get("cwd") or checks["path"]))
    if checks.get("cwd"):
        values["cwd"] = dir_state(cwd)
    program = checks.get("program")
    if program:
        values["prog"] = resolve_program(str(program), cwd, checks.get("path_env"))
    script = checks.get("pyscript")
    if script:
        if not os.path.isabs(script) and not os.path.isdir(cwd):
            values["pyscript"] = "nocwd"
        else:
            path = os.path.join(cwd, script)
            values["pyscript"] = "ok" if os.path.isfile(path) else \
                "dir" if os.path.isdir(path) else "missing"
    module = checks.get("pymodule")
    if module and values.get("prog", "").startswith("/"):
        if beat is not None:
            beat(0.0)
        values["pymodule"] = find_module(values["prog"], str(module), cwd,
                                         checks.get("pythonpath"))
    master = checks.get("master")
    if master:
        values["master"] = reach(str(master["host"]), int(master["port"]))
    target = checks.get("dial")
    if target:
        if beat is not None:
            beat(0.0)
        values["dial"] = dial(str(target["host"]), int(target["port"]), salt, run_id, host)
    values["end"] = "1"
    return values
