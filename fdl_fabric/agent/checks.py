"""The pre-flight on this host: facts only, gathered before any rank starts.

The one gatherer of host facts, for both pre-flights: a launch's (the cheap subset: the
working directory, the program resolved the way ``execvpe`` will, a ``python3 train.py``
script or a ``-m`` module, free disk, MASTER_ADDR, whether this host reaches *this*
run's coordinator) and ``prebuild-check``'s (also the platform, py-spy, the GPUs, the
data folder, this host's loopback identity). The spec's ``checks`` says what to look at;
the agent reports raw values under the names `fdl_fabric.preflight` judges (``path``,
``prog``, ``dial``...), so every verdict and its wording live in one place, on the
controller.

The coordinator check sends an authenticated ``probe`` frame (the run's salt keys it)
and checks the authenticated reply, so a different service on that port, or another
run's coordinator, is told apart from ours.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from fdl_fabric import rank
from fdl_fabric.agent import gpus

DIAL_TIMEOUT = 3.0
#: The ``dial`` value when the coordinator answered with this run's key.
DIAL_OK = "ok"
#: Seconds ``ldd`` gets.
TOOL_TIMEOUT = 10.0


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


def platform_facts() -> Dict[str, str]:
    """``arch`` (``uname -m``) and ``libc`` (the first line of ``ldd --version``, which
    `fdl_fabric.preflight.probe.parse_libc` reads): the controller's own are gathered by
    the same call, so a host and the controller are compared like for like."""
    try:
        done = subprocess.run(["ldd", "--version"], stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              timeout=TOOL_TIMEOUT, check=False)
        first = (done.stdout.decode("utf-8", "replace").splitlines() or [""])[0]
    except (OSError, subprocess.TimeoutExpired) as exc:
        first = f"ldd: {getattr(exc, 'strerror', None) or exc}"
    return {"arch": os.uname().machine, "libc": first.strip()}


def loopback_identity() -> str:
    """This host's network namespace and boot id: equal to the controller's means this
    host's 127.0.0.1 is the controller's own (same machine, same namespace), where a
    tunnel cannot bind. Empty where /proc does not say (then nothing is equal to it)."""
    try:
        netns = os.readlink("/proc/self/ns/net")
    except OSError:
        netns = ""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as fh:
            boot = fh.read().strip()
    except OSError:
        boot = ""
    return f"{netns} {boot}" if netns and boot else ""


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


class _Ask:
    """One gather: the spec's ``checks``, what the dial needs, and the values so far."""

    def __init__(self, checks: Dict[str, Any], salt: bytes, run_id: str, host: str,
                 beat: Callable[[float], None]) -> None:
        self.checks = checks
        self.beat = beat
        self.salt, self.run_id, self.host = salt, run_id, host
        self.path = os.path.expanduser(str(checks["path"]))
        self.cwd = os.path.expanduser(str(checks.get("cwd") or checks["path"]))
        self.values: Dict[str, str] = {}


def _path(ask: _Ask, _: Any) -> None:
    ask.values["path"] = dir_state(ask.path)
    try:
        st = os.statvfs(ask.path)
        ask.values["disk_kb"] = str(st.f_bavail * st.f_frsize // 1024)
    except OSError:
        ask.values["disk_kb"] = ""


def _cwd(ask: _Ask, _: Any) -> None:
    ask.values["cwd"] = dir_state(ask.cwd)


def _program(ask: _Ask, program: Any) -> None:
    ask.values["prog"] = resolve_program(str(program), ask.cwd, ask.checks.get("path_env"))


def _pyscript(ask: _Ask, script: Any) -> None:
    script = str(script)
    if not os.path.isabs(script) and not os.path.isdir(ask.cwd):
        ask.values["pyscript"] = "nocwd"
        return
    path = os.path.join(ask.cwd, script)
    ask.values["pyscript"] = "ok" if os.path.isfile(path) else \
        "dir" if os.path.isdir(path) else "missing"


def _pymodule(ask: _Ask, module: Any) -> None:
    """Only with a resolved interpreter: the row says why the program is missing."""
    python = ask.values.get("prog", "")
    if python.startswith("/"):
        ask.values["pymodule"] = find_module(python, str(module), ask.cwd,
                                             ask.checks.get("pythonpath"))


def _platform(ask: _Ask, _: Any) -> None:
    ask.values.update(platform_facts())


def _pyspy(ask: _Ask, _: Any) -> None:
    """Where this agent would find py-spy for stack dumps (`stacks.find_py_spy`)."""
    from fdl_fabric.agent import stacks

    ask.values["pyspy"] = stacks.find_py_spy() or ""


def _gpus(ask: _Ask, wanted: Any) -> None:
    """The GPUs' listing and health (`gpus.gather`: what ``wanted`` asks)."""
    ask.values.update(gpus.gather(wanted if isinstance(wanted, dict) else {"listing": True},
                                  ask.cwd, ask.beat))


def _data(ask: _Ask, data_path: Any) -> None:
    path = os.path.expanduser(str(data_path))
    if not os.path.exists(path):
        ask.values["data"] = "missing"
    else:
        ask.values["data"] = "ok" if os.access(path, os.R_OK) else "unreadable"


def _netns(ask: _Ask, _: Any) -> None:
    ask.values["netns"] = loopback_identity()


def _master(ask: _Ask, master: Any) -> None:
    ask.values["master"] = reach(str(master["host"]), int(master["port"]))


def _ifaces(ask: _Ask, _: Any) -> None:
    """This host's interfaces (`fleet.interfaces`), for the ``nic`` row."""
    import json

    from fdl_fabric.agent import fleet

    ask.values["ifaces"] = json.dumps(fleet.interfaces(), separators=(",", ":"))


def _dial(ask: _Ask, target: Any) -> None:
    ask.values["dial"] = dial(str(target["host"]), int(target["port"]), ask.salt,
                              ask.run_id, ask.host)


#: What each key of the spec's ``checks`` gathers, in order (the program before its
#: module; the dial, which may wait longest, last). A key that is absent or null is not
#: asked. ``path`` is always asked.
_GATHERERS: List[Tuple[str, Callable[[_Ask, Any], None]]] = [
    ("path", _path), ("cwd", _cwd), ("program", _program), ("pyscript", _pyscript),
    ("pymodule", _pymodule), ("platform", _platform), ("pyspy", _pyspy), ("gpus", _gpus),
    ("data", _data), ("netns", _netns), ("ifaces", _ifaces), ("master", _master),
    ("dial", _dial),
]


def gather(checks: Dict[str, Any], salt: bytes, run_id: str, host: str,
           beat: Optional[Callable[[float], None]] = None) -> Dict[str, str]:
    """Every fact the spec asks for, as ``name -> value`` strings, ending ``end=1``.
    ``beat`` keeps the agent heard by its launcher between steps, some of which may wait
    (nvidia-smi, a module lookup, the dial)."""
    ask = _Ask(checks, salt, run_id, host, beat or (lambda seconds: time.sleep(seconds)))
    for key, gatherer in _GATHERERS:
        arg = checks.get(key)
        if arg:
            ask.beat(0.0)
            gatherer(ask, arg)
    ask.values["end"] = "1"
    return ask.values
