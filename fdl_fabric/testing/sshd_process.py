"""The sshd listener processes: spawn them, wait until they answer, stop what they started.

Why a module of its own: the process lifecycle is where the lab must be careful: sshd
needs absolute paths to re-exec itself, a listening socket is not yet a working sshd
(hence the SSH banner probe), and stopping has to snapshot the process tree before
signalling anything and also find session processes that escaped the tree.  Both a
whole lab (``SshdLab``) and a single host (``LabHost.restart``/``stop``) go through
these functions.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Optional

import psutil

from .processes import POLL, LabError, log_tail, own_lineage, terminate, tree_levels
from .sshd_config import MARKER_ENV
from .sshd_registry import _BIND_REGISTRY, REGISTRY_MOUNTPOINT
from .sshd_tools import require_tool

if TYPE_CHECKING:
    from .sshd_host import LabHost


def _spawn_sshd(
    sshd: str,
    config: str,
    log_path: str,
    *,
    netns: Optional[str] = None,
    registry_dir: Optional[str] = None,
) -> subprocess.Popen[bytes]:
    """``sshd -D -e -f config`` with output appended to ``log_path``.

    * absolute sshd path: sshd re-execs itself for every connection and on SIGHUP;
    * absolute config path: sshd chdirs to / so a relative ``-f`` breaks SIGHUP restarts;
    * own session: Ctrl-C in the test terminal must not hit the listeners before the
      fixture teardown gets to stop them in order;
    * ``registry_dir``: sshd runs in its own mount namespace (``unshare --mount``) where
      REGISTRY_MOUNTPOINT is that folder; sessions inherit the namespace;
    * ``netns``: sshd runs in that network namespace (``ip netns exec``).

    ``ip netns exec``, ``unshare`` and ``sh`` all exec, so the Popen's pid is sshd's.
    """
    argv = [sshd, "-D", "-e", "-f", config]
    if registry_dir is not None:
        unshare = require_tool("unshare")
        argv = [unshare, "--mount", "--propagation", "private", "--", "/bin/sh", "-c",
                _BIND_REGISTRY, "fdl-lab-registry", registry_dir, REGISTRY_MOUNTPOINT, *argv]
    if netns is not None:
        argv = [require_tool("ip"), "netns", "exec", netns, *argv]
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,
            close_fds=True,
        )


def _read_banner(addr: str, port: int, timeout: float = 1.0) -> bool:
    """True if something at addr:port speaks SSH, i.e. sends an ``SSH-`` banner line.

    A TCP connect alone is not enough: it succeeds as soon as the socket listens, before
    sshd has loaded its keys, and it cannot tell our sshd from a stranger on that port.
    """
    try:
        with socket.create_connection((addr, port), timeout=timeout) as sock:
            data = b""
            while b"\n" not in data and len(data) < 512:
                chunk = sock.recv(512)
                if not chunk:
                    break
                data += chunk
            if data.startswith(b"SSH-"):
                # Identify ourselves so the sshd log names the probe instead of
                # reporting a bare "kex_exchange_identification" error.
                sock.sendall(b"SSH-2.0-fdl_fabric.testing-probe\r\n")
    except OSError:
        return False
    return data.startswith(b"SSH-")


def _wait_ready(
    hosts: Sequence[LabHost],
    timeout: float,
    *,
    log_offsets: Optional[dict[LabHost, int]] = None,
    bind_failures: Optional[list[LabHost]] = None,
) -> None:
    """Block until every host's sshd answers with an SSH banner.

    Raises LabError (with the sshd log) when an sshd exits or ``timeout`` passes.  If
    ``bind_failures`` is given, hosts whose sshd exited because the port was taken are
    put there instead, so the caller can retry on another port.

    With ``log_offsets`` (after SIGHUP) a host only counts once its log shows a fresh
    "Server listening" line: until the old listener has closed its socket, a banner can
    still come from the process image that holds the old host key.
    """
    pending = list(hosts)
    deadline = time.monotonic() + timeout
    while pending:
        pending = [h for h in pending if not _answered(h, log_offsets, bind_failures)]
        if not pending:
            break
        if time.monotonic() > deadline:
            details = "\n".join(
                f"--- {h.name} ({h.addr}:{h.port}) log {h.log_path}:\n{log_tail(h.log_path)}"
                for h in pending
            )
            raise LabError(f"sshd not answering after {timeout:.0f} s:\n{details}")
        time.sleep(POLL)
    # Our banner probes each forked a per-connection sshd; let them exit so callers see
    # a quiet host (session_pids() == [] before the first real connection).
    settle = time.monotonic() + 1.0
    for host in hosts:
        while time.monotonic() < settle and _probe_children(host):
            time.sleep(POLL)


def _answered(host: LabHost, log_offsets: Optional[dict[LabHost, int]],
              bind_failures: Optional[list[LabHost]]) -> bool:
    """True once ``host`` needs no more waiting for: its sshd answers with a banner, or it
    exited on a taken port (put in ``bind_failures``); an sshd that exited otherwise
    raises LabError with its log."""
    rc = host.sshd.poll()
    if rc is not None:
        log = log_tail(host.log_path)
        if bind_failures is not None and (
            "Address already in use" in log or "Cannot bind any address" in log
        ):
            bind_failures.append(host)
            return True
        raise LabError(
            f"sshd for {host.name} ({host.addr}:{host.port}) exited with {rc} "
            f"during startup; log {host.log_path}:\n{log}"
        )
    if not _listening_again(host, log_offsets):
        return False
    return _read_banner(host.addr, host.port)


def _listening_again(host: LabHost, log_offsets: Optional[dict[LabHost, int]]) -> bool:
    """After a SIGHUP (``log_offsets``): whether the log shows a fresh "Server listening"
    line past the host's offset. Without one, always True."""
    if log_offsets is None or host not in log_offsets:
        return True
    with open(host.log_path, "rb") as fh:
        fh.seek(log_offsets[host])
        fresh = fh.read()
    return f"Server listening on {host.addr} port {host.port}".encode() in fresh


def _probe_children(host: LabHost) -> bool:
    """True while the listener has unauthenticated (e.g. probe) children alive."""
    if host.sshd.poll() is not None:
        return False
    try:
        kids = psutil.Process(host.sshd.pid).children()
    except psutil.Error:
        return False
    return len(kids) > len(host.session_pids())


def _marked_processes(hosts: Sequence[LabHost]) -> list[psutil.Process]:
    """Processes whose environment says they run in a session on one of ``hosts``.

    Matches our ``MARKER_ENV`` token or an ``SSH_CONNECTION`` whose server end is a lab
    host's addr/port (for sessions that rewrote the rest of their environment).  Both
    are set by sshd for sessions only, so this finds only what the lab started.
    """
    markers = {h.marker for h in hosts}
    endpoints = {(h.addr, str(h.port)) for h in hosts}
    skip = own_lineage()
    found = []
    for proc in psutil.process_iter():
        if proc.pid in skip:
            continue
        try:
            env = proc.environ()
        except (psutil.Error, OSError):
            continue
        conn = env.get("SSH_CONNECTION", "").split()
        if env.get(MARKER_ENV) in markers or (len(conn) == 4 and (conn[2], conn[3]) in endpoints):
            found.append(proc)
    return found


def _stop_hosts(hosts: Sequence[LabHost], grace: float = 2.0) -> None:
    """Stop the listeners of ``hosts`` and everything their sessions started.

    Order matters.  The process tree is snapshotted *before* anything is signalled,
    because once a listener or per-connection sshd dies its children are re-parented to
    init and no longer show up as descendants.  Then processes are terminated deepest
    first (escaped session processes, then shells/ranks, then per-connection sshd, then
    listeners): each parent is still alive to reap its children, so no zombies pile up
    under an init that may not reap.  Finally the environment scan runs again for
    anything a session spawned while being torn down (``bash -c "a; b"`` starts ``b``
    when ``a`` is killed).
    """
    depth_levels: list[list[psutil.Process]] = []
    in_tree: set[int] = set()
    for host in hosts:
        if host.sshd.poll() is not None:
            continue
        for depth, level in enumerate(tree_levels(host.sshd.pid)):
            while len(depth_levels) <= depth:
                depth_levels.append([])
            depth_levels[depth].extend(level)
            in_tree.update(p.pid for p in level)
    escaped = [p for p in _marked_processes(hosts) if p.pid not in in_tree]

    terminate(escaped, grace)
    for level in reversed(depth_levels):
        terminate(level, grace)

    running = [h for h in hosts if h.sshd.poll() is None]
    for host in running:
        with contextlib.suppress(ProcessLookupError):
            host.sshd.terminate()
    deadline = time.monotonic() + grace
    for host in running:
        try:
            host.sshd.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            host.sshd.kill()
            host.sshd.wait()

    late = _marked_processes(hosts)
    if late:
        terminate(late, grace)
