"""The interpreter and library versions this host's ranks will run with: facts only.

Hosts that train together must agree on Python, torch and NCCL, or a run fails late and
obscurely (a pickling error, an NCCL hang, a different numerics path). The launch asks
each agent for the versions its ranks will see, and `fdl_fabric.preflight.versions`
compares them across hosts, so every verdict and its wording stay on the controller.

The versions are read by the ranks' own interpreter (``python:`` in cluster.yml, which
may be a venv's), not by the agent's, which is the host's system ``python3``. It runs a
short script with ``-c``: ``importlib.metadata`` answers package versions from the
installed metadata without importing anything; torch is imported only when its build
has a GPU backend, as only then is there an NCCL version to read, and importing it
takes seconds. The interpreter is bounded by a timeout and killed with its process
group after it, so a broken venv or a hanging ``sitecustomize`` never holds up a launch.
The answer is kept on the host while nothing it rests on changed (`versioncache`), so
most launches start no interpreter for it.

Standard library only, Python 3.8 syntax: this module ships to hosts in the agent bundle.
"""

from __future__ import annotations

import json
import os
import subprocess
from typing import Any, Callable, Dict, List, Optional

from fdl_fabric.agent import bounded, versioncache
from fdl_fabric.agent.checks import resolve_program

#: Seconds the interpreter may take when the request does not say (an import of torch
#: with CUDA takes a few; a cold disk more).
DEFAULT_TIMEOUT = 30.0
#: The longest stderr line quoted in an error.
_QUOTE_MAX = 300

#: What the interpreter runs (``-c``; argv[1] is the JSON list of packages, or null).
#: Written for any Python 3: the ranks' interpreter may be older than the agent's rules.
#: It prints one JSON line, last, so a banner from a ``sitecustomize`` cannot hide it.
SCRIPT = r"""
import json, platform, sys
asked = json.loads(sys.argv[1])
try:
    from importlib import metadata as md
except ImportError:
    try:
        import importlib_metadata as md
    except ImportError:
        md = None

def version(name):
    try:
        if md is None:
            import pkg_resources
            return str(pkg_resources.get_distribution(name).version)
        return str(md.version(name))
    except Exception:
        return None

def gpu_build():
    # torch/version.py, run on its own: whether this torch has a GPU backend, without
    # importing torch (seconds). None when it cannot tell.
    try:
        import importlib.util, os
        spec = importlib.util.find_spec("torch")
        where = list(spec.submodule_search_locations or [])
        ns = {}
        with open(os.path.join(where[0], "version.py")) as fh:
            exec(compile(fh.read(), "torch/version.py", "exec"), ns)
        return ns.get("cuda"), bool(ns.get("cuda") or ns.get("hip"))
    except Exception:
        return None, None

def nccl_text(v):
    if isinstance(v, (tuple, list)):
        return ".".join(str(int(x)) for x in v)
    v = int(v)
    if v >= 10000:
        return "%d.%d.%d" % (v // 10000, v // 100 % 100, v % 100)
    return "%d.%d.%d" % (v // 1000, v // 100 % 10, v % 100)

names = ["torch"] if asked is None else asked
packages = {}
for name in names:
    got = version(name)
    if got is not None or asked is not None:
        packages[name] = got
out = {"python": platform.python_version(), "executable": sys.executable,
       "packages": packages, "torch_cuda": None, "cuda_available": None, "nccl": None,
       "paths": list(sys.path)}
if version("torch") is not None:
    cuda, gpu = gpu_build()
    out["torch_cuda"] = cuda
    if gpu is None or gpu:
        try:
            import torch
            out["torch_cuda"] = torch.version.cuda
            out["cuda_available"] = bool(torch.cuda.is_available())
            if out["cuda_available"]:
                out["nccl"] = nccl_text(torch.cuda.nccl.version())
        except Exception as exc:
            out["torch_error"] = "%s: %s" % (type(exc).__name__, exc)
    else:
        out["cuda_available"] = False
sys.stdout.write("\n" + json.dumps(out) + "\n")
"""


def gather(request: Dict[str, Any],
           beat: Optional[Callable[[float], None]] = None) -> Dict[str, Any]:
    """The versions the ranks' interpreter sees, or ``{"error": why}``.

    ``request``: ``python`` (as configured: ``.venv/bin/python`` or ``python3``),
    ``cwd`` (the ranks' folder: a relative ``python`` resolves against it, as ``execvpe``
    does after the rank's ``chdir``), ``packages`` (names, or None for torch when
    installed), ``timeout`` (seconds), and optionally ``env`` (variables the ranks get
    over this agent's own, e.g. ``PATH`` or ``PYTHONPATH`` from cluster.yml). ``beat``
    is called (with 0.0, like `checks.gather`'s) every `bounded.BEAT_EVERY` seconds while the
    interpreter runs, so the agent stays heard.
    """
    python = str(request.get("python") or "python3")
    cwd = os.path.expanduser(str(request.get("cwd") or "."))
    packages = request.get("packages")
    names: Optional[List[str]] = None if packages is None else [str(p) for p in packages]
    timeout = float(request.get("timeout") or DEFAULT_TIMEOUT)
    env = dict(os.environ)
    env.update({str(k): str(v) for k, v in (request.get("env") or {}).items()})

    found = resolve_program(python, cwd, env.get("PATH"))
    if found.startswith("!"):
        return {"error": not_runnable(python, cwd, found)}
    launch_env = {str(k): str(v) for k, v in (request.get("env") or {}).items()}
    question = versioncache.key(found, cwd, names, env, launch_env)
    kept = versioncache.lookup(question)
    if kept is not None:
        return kept
    facts = _run(found, names, cwd, env, timeout, beat)
    versioncache.keep(question, found, cwd, facts)
    facts.pop(versioncache.PATHS, None)
    return facts


def not_runnable(python: str, cwd: str, why: str) -> str:
    """Why the interpreter cannot start, naming the file the ranks would have run."""
    if why == "!nocwd":
        return (f"cannot resolve interpreter {python}: the ranks' folder {cwd} does not "
                "exist")
    where = python if python.startswith("/") else \
        os.path.normpath(os.path.join(cwd, python)) if "/" in python else None
    if why == "!noexec":
        return f"interpreter at {where} is not executable"
    if where is None:
        return f"interpreter {python} not found on PATH"
    return f"interpreter not found at {where}"


def _run(python: str, names: Optional[List[str]], cwd: str, env: Dict[str, str],
         timeout: float, beat: Optional[Callable[[float], None]]) -> Dict[str, Any]:
    """Run the script under ``python`` in its own process group, killed (the whole group)
    after ``timeout``: no shell, stdin from /dev/null."""
    try:
        proc = subprocess.Popen(
            [python, "-c", SCRIPT, json.dumps(names)], cwd=cwd if os.path.isdir(cwd) else None,
            env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            start_new_session=True)
    except OSError as exc:
        return {"error": f"cannot start interpreter {python}: {exc.strerror or exc}"}
    done = bounded.communicate(proc, timeout, beat)
    if done is None:
        return {"error": f"interpreter {python} timed out after {timeout:g} s (killed)"}
    out, err = done[0], done[1] or b""
    if proc.returncode != 0:
        return {"error": _exit_words(python, proc.returncode, err)}
    return _parse(python, out)


def _exit_words(python: str, code: int, err: bytes) -> str:
    """``exited 1: <its last stderr line>``, or the signal that ended it."""
    how = f"killed by signal {-code}" if code < 0 else f"exited {code}"
    last = _last_line(err)
    return f"interpreter {python} {how}" + (f": {last}" if last else "")


def _parse(python: str, out: bytes) -> Dict[str, Any]:
    """The script's JSON line, checked for the keys the controller reads."""
    last = _last_line(out, bound=False)
    try:
        facts = json.loads(last)
    except ValueError:
        facts = None
    if not isinstance(facts, dict) or not isinstance(facts.get("packages"), dict):
        quoted = _last_line(out)
        return {"error": f"interpreter {python} printed no versions"
                         + (f": {quoted}" if quoted else "")}
    return facts


def _last_line(data: bytes, bound: bool = True) -> str:
    """The last non-empty line of ``data``, decoded (and bounded, to be quoted)."""
    for line in reversed(data.decode("utf-8", "replace").splitlines()):
        if line.strip():
            line = line.strip()
            return line if not bound or len(line) <= _QUOTE_MAX else line[:_QUOTE_MAX] + "…"
    return ""
