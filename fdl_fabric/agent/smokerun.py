"""The collective smoke test on this host: each rank slot runs a tiny program with the
run's rank environment and interpreter (`fdl_fabric.preflight.smoke` asks and judges).

A multi-node job that hangs at init says nothing of why; this runs, before any rank,
what every rank's first seconds do: import torch, ``init_process_group`` on the run's
backend with the run's ``MASTER_ADDR``/``MASTER_PORT``, one all-reduce checked for the
right sum (each rank gives rank+1: the sum is world*(world+1)/2), one barrier. A slot
that cannot, or does not within the bound, is answered with why.

Each slot gets exactly a rank's environment, merged as the agent merges a rank's
(`ranks.base_env`: the request's ``defaults``, then this host's environment, then the
host's common ``env``, then the slot's own), less the envelope: the program never talks
to the coordinator, and a secret need not travel twice. A relative ``python`` resolves
against the ranks' folder, as a rank's ``execvpe`` does after its ``chdir``.

Bounded three ways, so nothing outlives the check: the agent KILLs every slot's
process group when the bound passes and whenever `run` leaves (``finally``); each slot
asks the kernel for SIGKILL when the agent dies (``PR_SET_PDEATHSIG``, Linux, best
effort); and the program arms its own ``alarm`` just past the bound. Its collective
timeout ends a few seconds before the bound, so a slot waiting for a peer that never
comes says so itself (torch's "waiting for clients" error) rather than being killed.

torch missing is told apart from torch failing: the program exits `NO_TORCH` when
``import torch`` finds no torch, and the slot is answered ``skipped`` (the controller
says it once when every slot is; a slot whose peers did import it is a FAIL there).

Standard library only, Python 3.8 syntax: this module ships to hosts in the agent bundle.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import subprocess
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from fdl_fabric.agent.checks import resolve_program
from fdl_fabric.agent.ranks import base_env
from fdl_fabric.agent.versions import not_runnable

#: The bound when the request gives none: seconds from the first slot's start to the
#: last slot's kill.
DEFAULT_TIMEOUT = 25.0
#: Seconds before the bound at which the program's collective timeout ends, so a slot
#: whose peers never came says so itself before it is killed.
COLLECTIVE_SLACK = 3.0
#: The program's exit code when the interpreter has no torch to import.
NO_TORCH = 87
#: Seconds between two looks at the slots; the agent's ``beat`` sleeps them.
POLL = 0.05
#: Bytes of each slot's stdout and stderr kept (the last ones: the error is at the end).
OUTPUT_CAP = 16 * 1024
#: The longest error quoted in an answer.
_QUOTE_MAX = 300
#: What the program's answer line starts with: a ``sitecustomize`` banner cannot pass
#: for it.
MARK = "FDL-SMOKE "
#: ``prctl(PR_SET_PDEATHSIG, ...)``.
_PR_SET_PDEATHSIG = 1

#: What each slot runs (``-c``; argv: backend, the bound as a wall-clock time, slack,
#: the exit code for "no torch"). Written for any Python 3: the ranks' interpreter may be
#: older than the agent's rules. Its answer is one JSON line after `MARK`, flushed before
#: ``os._exit``: torch CPU builds may abort at interpreter exit after gloo work.
PROGRAM = r"""
import json, os, signal, sys, time
backend, deadline = sys.argv[1], float(sys.argv[2])
slack, no_torch = float(sys.argv[3]), int(sys.argv[4])
started = time.time()
if hasattr(signal, "alarm"):
    signal.alarm(max(1, int(deadline - started) + 2))

def say(code, **answer):
    sys.stdout.write("\nFDL-SMOKE " + json.dumps(answer) + "\n")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

try:
    import torch
except ImportError as exc:
    if getattr(exc, "name", None) == "torch":
        say(no_torch, skipped="%s: %s" % (type(exc).__name__, exc))
    raise

def first_line(exc):
    lines = [l.strip() for l in str(exc).splitlines() if l.strip()]
    return "%s: %s" % (type(exc).__name__, lines[0] if lines else "")

try:
    import datetime
    import torch.distributed as dist
    if not dist.is_available():
        raise RuntimeError("this torch was built without torch.distributed")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device, index = torch.device("cpu"), None
    if backend == "nccl":
        count = torch.cuda.device_count()
        if count < 1:
            raise RuntimeError("no CUDA device visible (CUDA_VISIBLE_DEVICES=%s)"
                               % os.environ.get("CUDA_VISIBLE_DEVICES", "unset"))
        index = 0 if count == 1 else int(os.environ.get("LOCAL_RANK", "0")) % count
        torch.cuda.set_device(index)
        device = torch.device("cuda", index)
    began = time.time()
    timeout = max(1.0, deadline - began - slack)
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout))
    x = torch.full((8,), rank + 1, dtype=torch.int64, device=device)
    dist.all_reduce(x)
    want = world * (world + 1) // 2
    got = x.tolist()
    if got != [want] * 8:
        raise RuntimeError("all_reduce summed to %s, expected %d everywhere" % (got, want))
    if index is None:
        dist.barrier()
    else:
        dist.barrier(device_ids=[index])
    dist.destroy_process_group()
    say(0, ok=True, collective=round(time.time() - began, 3))
except Exception as exc:
    import traceback
    traceback.print_exc()
    say(1, ok=False, error=first_line(exc))
"""


class _Slot:
    """One rank slot: its process, what it wrote (the last `OUTPUT_CAP` bytes of each
    stream) and its answer once known."""

    def __init__(self, rank: int, env: Dict[str, str]) -> None:
        self.rank = rank
        self.env = env
        self.proc: Optional[subprocess.Popen[bytes]] = None
        self.out = bytearray()
        self.err = bytearray()
        self.began = 0.0
        self.seconds = 0.0
        #: Whether it ended before the bound (else `_kill` ended it).
        self.exited = False
        self.answer: Optional[Dict[str, Any]] = None

    def read(self) -> None:
        """What its pipes hold now, without blocking."""
        proc = self.proc
        if proc is None:
            return
        for pipe, buf in ((proc.stdout, self.out), (proc.stderr, self.err)):
            if pipe is None or pipe.closed:
                continue
            while True:
                try:
                    data = os.read(pipe.fileno(), 65536)
                except BlockingIOError:
                    break
                except OSError:
                    data = b""
                if not data:
                    pipe.close()
                    break
                buf += data
                del buf[:-OUTPUT_CAP]

    def entry(self) -> Dict[str, Any]:
        answer = self.answer or {}
        return {"rank": self.rank, "ok": bool(answer.get("ok")),
                "seconds": round(self.seconds, 3), "collective": answer.get("collective"),
                "error": answer.get("error"), "skipped": answer.get("skipped")}


def run(request: Dict[str, Any], beat: Callable[[float], None]) -> Dict[str, Any]:
    """Every slot of ``request``, bounded; one entry per slot (``slots``).

    ``request``: ``python`` (as configured), ``cwd`` (the ranks' folder), ``env`` (what
    the host's ranks share), ``defaults``, ``slots`` (``[{"rank", "env"}]``, each with its
    own variables), ``backend`` (``gloo`` or ``nccl``) and ``timeout`` (the bound, in
    seconds). ``beat`` sleeps the seconds it is given and keeps the agent heard.
    """
    python = str(request.get("python") or "python3")
    cwd = os.path.expanduser(str(request.get("cwd") or "."))
    backend = str(request.get("backend") or "gloo")
    timeout = float(request.get("timeout") or DEFAULT_TIMEOUT)
    slots, path = _slots_of(request)
    found = resolve_program(python, cwd, path)
    answer: Dict[str, Any] = {"python": found, "backend": backend, "timeout": timeout}
    if found.startswith("!"):
        why = not_runnable(python, cwd, found)
        answer["slots"] = [{**s.entry(), "error": why} for s in slots]
        return answer
    began = time.monotonic()
    try:
        _start(slots, [found, "-c", PROGRAM, backend, repr(time.time() + timeout),
                       repr(COLLECTIVE_SLACK), str(NO_TORCH)], cwd)
        _watch(slots, began + timeout, beat)
    finally:
        _kill(slots)
    for slot in slots:
        _conclude(slot, found, timeout)
    answer["slots"] = [s.entry() for s in slots]
    answer["seconds"] = round(time.monotonic() - began, 3)
    return answer


def _slots_of(request: Dict[str, Any]) -> Tuple[List[_Slot], Optional[str]]:
    """The request's slots, each with its whole environment, and the ``PATH`` they share
    (where a bare ``python`` is looked for)."""
    common = base_env({"defaults": request.get("defaults") or {},
                       "env": _strings(request.get("env"))})
    slots = [_Slot(int(s["rank"]), {**common, **_strings(s.get("env"))})
             for s in request.get("slots") or []]
    return slots, common.get("PATH")


def _strings(mapping: Any) -> Dict[str, str]:
    return {str(k): str(v) for k, v in (mapping or {}).items()}


def _start(slots: List[_Slot], argv: List[str], cwd: str) -> None:
    """Start every slot at once (they wait for each other), each in a session of its own
    with stdin from /dev/null; a slot that cannot start is answered at once."""
    for slot in slots:
        slot.began = time.monotonic()
        try:
            slot.proc = subprocess.Popen(
                argv, cwd=cwd, env=slot.env, stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                preexec_fn=functools.partial(_die_with_parent, os.getpid()))
        except OSError as exc:
            slot.answer = {"error": f"cannot start interpreter {argv[0]}: "
                                    f"{exc.strerror or exc}"}
            continue
        for pipe in (slot.proc.stdout, slot.proc.stderr):
            if pipe is not None:
                os.set_blocking(pipe.fileno(), False)


def _watch(slots: List[_Slot], deadline: float, beat: Callable[[float], None]) -> None:
    """Read every slot's output until each has exited or the bound passed."""
    while True:
        running = 0
        for slot in slots:
            if slot.proc is None or slot.exited:
                continue
            slot.read()
            slot.seconds = time.monotonic() - slot.began
            if slot.proc.poll() is None:
                running += 1
            else:
                slot.exited = True
                slot.read()
        if not running or time.monotonic() >= deadline:
            return
        beat(POLL)


def _kill(slots: List[_Slot]) -> None:
    """KILL every slot's process group (what a slot left behind too), reap the slots and
    close their pipes: nothing the check started outlives it. A group whose every
    process is gone keeps its id unused, so the KILL can reach no one else."""
    for slot in slots:
        if slot.proc is None:
            continue
        with contextlib.suppress(OSError):
            os.killpg(slot.proc.pid, signal.SIGKILL)
    for slot in slots:
        if slot.proc is None:
            continue
        slot.proc.wait()
        slot.read()
        for pipe in (slot.proc.stdout, slot.proc.stderr):
            if pipe is not None and not pipe.closed:
                pipe.close()


def _conclude(slot: _Slot, python: str, timeout: float) -> None:
    """The slot's answer: the program's own line when it printed one, else how it ended
    and the last line it wrote."""
    if slot.proc is None:  # never started: answered by `_start`
        return
    said = _said(slot.out)
    if said is not None:
        if said.get("skipped") is not None:
            said["skipped"] = f"{python}: {_bound(str(said['skipped']))}"
        elif said.get("error") is not None:
            said["error"] = _bound(str(said["error"]))
        slot.answer = said
        return
    last = _last_line(bytes(slot.err)) or _last_line(bytes(slot.out))
    if not slot.exited:  # still running at the bound: killed
        how = f"did not finish within {timeout:g} s (killed)"
    else:
        code = slot.proc.returncode
        how = f"killed by signal {-code}" if code < 0 else f"exited {code}"
    slot.answer = {"ok": False, "error": how + (f"; it last said: {last}" if last else "")}


def _said(out: bytearray) -> Optional[Dict[str, Any]]:
    """The program's answer line (the last one after `MARK`), if it wrote one."""
    for line in reversed(out.decode("utf-8", "replace").splitlines()):
        if line.startswith(MARK):
            try:
                said = json.loads(line[len(MARK):])
            except ValueError:
                return None
            return said if isinstance(said, dict) else None
    return None


def _last_line(data: bytes) -> str:
    for line in reversed(data.decode("utf-8", "replace").splitlines()):
        if line.strip():
            return _bound(line.strip())
    return ""


def _bound(text: str) -> str:
    return text if len(text) <= _QUOTE_MAX else text[:_QUOTE_MAX] + "…"


def _die_with_parent(parent: int) -> None:  # pragma: no cover - runs in the child, before exec
    """Ask the kernel for SIGKILL when the agent dies (Linux; elsewhere the program's own
    alarm still ends it)."""
    with contextlib.suppress(Exception):
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the agent died before the request took: go too
        os._exit(1)


def _libc() -> Any:
    """libc, loaded once in the agent (as `main` loads it: the process's own symbols, no
    ``ldconfig`` run): the child, between fork and exec, only calls it."""
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True)
    except Exception:
        return None


_LIBC = _libc()
