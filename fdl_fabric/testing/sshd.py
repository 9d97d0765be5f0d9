"""The sshd lab: real OpenSSH servers on loopback addresses, one per simulated host.

Why real sshd rather than a paramiko stub server: the launcher's hard problems (host keys,
``accept-new``, session limits, remote forwards, what dies when a connection drops) are
properties of OpenSSH itself, and a stub would happily agree with whatever bug we write.
Every lab host is therefore a genuine ``sshd -D`` listening on its own 127.x.y.z address
(Linux routes all of 127.0.0.0/8 to ``lo``), so "host" identity in logs,
``SSH_CONNECTION`` and known_hosts entries is distinct per host, exactly as on a cluster.

The lab is Linux-only (other systems only answer on 127.0.0.1) and needs ``sshd`` and
``ssh-keygen`` (Debian/Ubuntu package ``openssh-server``).  Sessions log in as the user
running the lab; our CI runs as root (``PermitRootLogin prohibit-password``).  A non-root
user makes sshd run unprivileged, which OpenSSH supports for logging in that same user,
but that mode is not exercised by our CI.  Because the lab uses ``UsePAM no``, sshd
itself refuses accounts whose shadow password field is locked (``!``, which ``useradd``
leaves by default) even for key logins: give such users ``*`` instead.
"""

from __future__ import annotations

import contextlib
import functools
import getpass
import ipaddress
import os
import pwd
import random
import re
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

import psutil
import yaml

from ..agent.procs import registry_dir
from .processes import (
    POLL,
    LabError,
    free_port,
    log_tail,
    own_lineage,
    stop_at_exit,
    stopped,
    terminate,
    tree_levels,
)

#: Environment variable that every lab session carries (sshd ``SetEnv``).  Its value names
#: the lab and host, so ``stop()`` can find session processes that escaped the sshd process
#: tree (``setsid cmd &`` re-parents them to init, out of reach of ``children()``).
MARKER_ENV = "FDL_FABRIC_LAB_HOST"


#: The run registry that fdl-fabric's rank wrappers write on every host (see
#: ``fdl_fabric.commands.REGISTRY_DIR``).  With ``private_registry=True`` each lab host's
#: sshd runs in its own mount namespace where this folder is a bind mount of a folder of
#: the lab, so every host has a registry of its own, as on a real cluster, and cleanup
#: tests never touch the records of ranks that other test runs keep in the real one.
REGISTRY_MOUNTPOINT = registry_dir()


#: Where Debian/Ubuntu put sshd; preferred because root's PATH may not include sbin dirs.
_SSHD_CANDIDATES = ("/usr/sbin/sshd", "/usr/local/sbin/sshd", "/sbin/sshd")


SBIN_PATH = "/usr/local/sbin:/usr/sbin:/sbin"


#: Process titles of per-connection sshd processes that have not authenticated anyone
#: yet (our own readiness probes, port scanners); these do not "serve a session".
_UNAUTHENTICATED_TITLES = ("[accepted]", "[preauth]", "[net]", "[listener]", " -R")


def _find_sshd() -> Optional[str]:
    """Absolute path of sshd, or None.

    sshd refuses to re-exec itself unless started with an absolute path, so a bare
    ``sshd`` from PATH is resolved here once.
    """
    for candidate in _SSHD_CANDIDATES:
        if os.access(candidate, os.X_OK):
            return candidate
    found = shutil.which("sshd") or shutil.which("sshd", path=SBIN_PATH)
    return os.path.abspath(found) if found else None


def _find_keygen() -> Optional[str]:
    return shutil.which("ssh-keygen") or shutil.which("ssh-keygen", path=SBIN_PATH)


def sshd_available() -> bool:
    """True if this machine can run a lab: an sshd binary and ssh-keygen exist."""
    return _find_sshd() is not None and _find_keygen() is not None


@functools.cache
def _sshd_version(sshd: str) -> tuple[int, int]:
    """(major, minor) of the OpenSSH server, (0, 0) if it cannot be told.

    Needed because OpenSSH 9.8 added PerSourcePenalties, which would make the lab refuse
    connections from 127.0.0.1 after fault tests kill per-connection sshd processes (a
    "crash" penalty), and older servers reject the option as unknown.
    """
    try:
        out = subprocess.run(
            [sshd, "-V"], stdin=subprocess.DEVNULL, capture_output=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return (0, 0)
    match = re.search(rb"OpenSSH_(\d+)\.(\d+)", out.stdout + out.stderr)
    return (int(match.group(1)), int(match.group(2))) if match else (0, 0)


def _ensure_privsep_dir() -> None:
    """Create /run/sshd, which a root sshd insists on (privilege separation chroot).

    Containers and CI images often have openssh-server installed but never booted, so
    the tmpfs directory that the init script would create is missing.  A non-root sshd
    does not chroot and does not need it.
    """
    if os.geteuid() != 0 or os.path.isdir("/run/sshd"):
        return
    os.makedirs("/run/sshd", mode=0o755, exist_ok=True)
    os.chmod("/run/sshd", 0o755)


def _pick_addresses(n_hosts: int, base_addr: Optional[str]) -> list[str]:
    """Consecutive loopback addresses, from ``base_addr`` or a random base.

    A random base in 127.1.0.0-127.254.255.255 keeps concurrent labs (pytest-xdist, two
    developers' test runs) apart and stays clear of well-known loopback users such as
    127.0.0.1, Debian's 127.0.1.1 and systemd-resolved's 127.0.0.53.  Distinct addresses
    also make ``SSH_CONNECTION`` identify the lab host unambiguously.
    """
    if n_hosts > 250:
        raise ValueError("a lab has at most 250 hosts (one /24 of loopback addresses)")
    if base_addr is not None:
        base = ipaddress.IPv4Address(base_addr)
    else:
        # Last octet from 2 so no host sits on a .0/.1 address that people recognise.
        base = ipaddress.IPv4Address(
            f"127.{random.randint(1, 254)}.{random.randint(0, 255)}."
            f"{random.randint(2, 254 - n_hosts)}"
        )
    addrs = [base + i for i in range(n_hosts)]
    loopback = ipaddress.IPv4Network("127.0.0.0/8")
    if any(a not in loopback or a == loopback.broadcast_address for a in addrs):
        raise ValueError(f"{n_hosts} hosts from {base} do not fit in 127.0.0.0/8")
    return [str(a) for a in addrs]


def _generate_keys(keygen: str, specs: Sequence[tuple[Path, str]]) -> None:
    """Generate passphrase-less ed25519 keys (path, comment) with ssh-keygen, in parallel.

    Existing files are removed first: ssh-keygen would otherwise ask "Overwrite (y/n)?",
    read EOF from stdin and fail.
    """
    procs: list[tuple[Path, subprocess.Popen[bytes]]] = []
    for path, comment in specs:
        for stale in (path, path.with_name(path.name + ".pub")):
            with contextlib.suppress(FileNotFoundError):
                stale.unlink()
        argv = [keygen, "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)]
        procs.append(
            (
                path,
                subprocess.Popen(
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                ),
            )
        )
    errors = []
    for path, proc in procs:
        out, _ = proc.communicate(timeout=30)
        if proc.returncode != 0:
            errors.append(f"ssh-keygen for {path} failed ({proc.returncode}): {out.decode()}")
    if errors:
        raise LabError("\n".join(errors))


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


def _clear_stale_pyenv_lock() -> None:
    """Remove pyenv's rehash lock if a lab session killed mid-rehash left it behind (no
    rehash runs any more): otherwise every login shell of this user waits 60 s on it."""
    root = os.environ.get("PYENV_ROOT") or os.path.expanduser("~/.pyenv")
    lock = Path(root) / "shims" / ".pyenv-shim"
    if not lock.exists():
        return
    for proc in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error, TypeError):
            if any("pyenv-rehash" in word for word in proc.info["cmdline"] or ()):
                return  # a rehash is running: the lock is in use
    with contextlib.suppress(OSError):
        if time.time() - lock.stat().st_mtime > 5:
            lock.unlink()


def require_tool(name: str) -> str:
    """Absolute path of a system tool (``ip``, ``unshare``), or LabError."""
    found = shutil.which(name) or shutil.which(name, path=SBIN_PATH)
    if found is None:
        raise LabError(f"{name} not found (needed for this lab; install iproute2/util-linux)")
    return found


def _ensure_registry_mountpoint() -> None:
    """Make sure REGISTRY_MOUNTPOINT exists as a real folder, so hosts can mount over it.

    It is created exactly as a rank wrapper would create it (mode 0700, owned by us).
    """
    if os.geteuid() != 0:
        raise LabError("private_registry needs root (a mount namespace per lab host)")
    path = REGISTRY_MOUNTPOINT
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    if os.path.islink(path) or not os.path.isdir(path) or os.stat(path).st_uid != os.getuid():
        raise LabError(f"{path} is not a folder owned by this user; refusing to mount over it")


@dataclass(frozen=True)
class _SshdSettings:
    """What every host of one lab shares; kept on each LabHost so it can restart alone."""

    sshd: str
    root: Path
    authorized_keys: str
    max_sessions: Optional[int]
    #: Extra ``NAME=value`` words for the SetEnv line (login_shell_rc's HOME/BASH_ENV).
    session_env: tuple[str, ...]
    extra: tuple[str, ...]
    startup_timeout: float
    kill_grace: float
    #: sshd's ClientAliveInterval / ClientAliveCountMax: how long a silent client is kept.
    client_alive_interval: int = 5
    client_alive_count_max: int = 3


def _render_sshd_config(
    settings: _SshdSettings, name: str, addr: str, port: int, host_key: str, marker: str
) -> str:
    """One host's sshd_config.  Only our file is read (``-f``), never /etc/ssh/sshd_config.

    Notes on the less obvious lines:

    * StrictModes no: pytest's tmp folders are not laid out the way sshd wants ~/.ssh.
    * UsePAM no: PAM stacks are site-specific (limits, systemd sessions, MOTD scripts)
      and slow; sshd's own account checks are enough here.
    * AllowTcpForwarding yes: tunnel tests use remote forwards (``-R``).
    * SetEnv: sshd honours only the *first* SetEnv line, so every variable goes on one.
      login_shell_rc adds HOME and BASH_ENV there (see ``_write_login_rc``).
    * PerSourcePenalties no (OpenSSH >= 9.8): all lab clients come from 127.0.0.1, and
      fault tests that kill sshd children would otherwise get 127.0.0.1 penalised.
    """
    # PYENV_REHASH_TIMEOUT=0: a login shell whose rc file runs `pyenv init` rehashes under
    # a lock file; a session killed mid-rehash (fault tests kill sessions) leaves the lock,
    # and every later login shell of the user would then wait 60 s for it. With 0, a
    # shell that finds the lock taken skips the rehash instead of waiting.
    env = " ".join([f"{MARKER_ENV}={marker}", "PYENV_REHASH_TIMEOUT=0",
                    *settings.session_env])
    lines = [
        f"# sshd lab host {name}: generated by fdl_fabric.testing, read with sshd -f",
        f"Port {port}",
        f"ListenAddress {addr}:{port}",
        f"HostKey {host_key}",
        f"AuthorizedKeysFile {settings.authorized_keys}",
        f"PidFile {settings.root / (name + '.pid')}",
        "PermitRootLogin prohibit-password",
        "PubkeyAuthentication yes",
        "PasswordAuthentication no",
        "KbdInteractiveAuthentication no",
        "UsePAM no",
        "StrictModes no",
        "AllowTcpForwarding yes",
        "GatewayPorts no",
        "LogLevel VERBOSE",
        "PrintMotd no",
        "PrintLastLog no",
        "Subsystem sftp internal-sftp",
        f"ClientAliveInterval {settings.client_alive_interval}",
        f"ClientAliveCountMax {settings.client_alive_count_max}",
        f"SetEnv {env}",
    ]
    if settings.max_sessions is not None:
        lines.append(f"MaxSessions {settings.max_sessions}")
    if _sshd_version(settings.sshd) >= (9, 8):
        lines.append("PerSourcePenalties no")
    lines.extend(settings.extra)
    return "\n".join(lines) + "\n"


def _write_login_rc(root: Path, rc_text: str, real_home: str) -> tuple[str, ...]:
    """Install ``rc_text`` as an extra shell rc; return the session env words that enable it.

    The obvious ``SetEnv BASH_ENV=rc`` does *not* work for ``ssh host cmd``: a bash that
    believes sshd started it (stdin a socket, or, in builds with SSH_SOURCE_BASHRC such
    as Debian's, SSH_CLIENT set) sources ~/.bashrc and skips $BASH_ENV.  So the
    sessions get ``HOME=<root>/login_home``, whose .bashrc (and .profile, for ``ssh -t``
    login shells) puts the real HOME back, sources the real rc file and then ``rc_text``.
    BASH_ENV is set too, for bash builds that do take the BASH_ENV path; every wrapper
    unsets it so nested bash scripts do not run ``rc_text`` again.
    """
    home = root / "login_home"
    home.mkdir(parents=True, exist_ok=True)
    rc_file = root / "login_shell_rc.sh"
    rc_file.write_text(rc_text + "\n")
    prologue = (
        "# Generated by fdl_fabric.testing (login_shell_rc): sshd set HOME to this folder\n"
        "# so that bash reads this file; restore the real home first.\n"
        f"export HOME={shlex.quote(real_home)}\n"
        "unset BASH_ENV\n"
    )
    (home / ".bashrc").write_text(
        prologue + '[ -f "$HOME/.bashrc" ] && . "$HOME/.bashrc"\n' + f". {rc_file}\n"
    )
    (home / ".profile").write_text(
        prologue
        + "for _fdl_lab_rc in .bash_profile .bash_login .profile; do\n"
        + '    if [ -f "$HOME/$_fdl_lab_rc" ]; then . "$HOME/$_fdl_lab_rc"; break; fi\n'
        + "done\n"
        + "unset _fdl_lab_rc\n"
        + f". {rc_file}\n"
    )
    (home / "bash_env.sh").write_text(prologue + f". {rc_file}\n")
    return (f"HOME={home}", f"BASH_ENV={home / 'bash_env.sh'}")


@dataclass(eq=False)
class LabHost:
    """One simulated host: an ``sshd -D`` listener on its own loopback address.

    ``eq=False`` keeps identity semantics, so hosts can be dict keys and set members.
    """

    name: str
    addr: str
    port: int
    path: str
    sshd: subprocess.Popen[bytes]
    host_key_pub: str
    host_key_path: str = field(default="", repr=False)
    config_path: str = field(default="", repr=False)
    log_path: str = field(default="", repr=False)
    #: Value of MARKER_ENV in this host's sessions.
    marker: str = field(default="", repr=False)
    _settings: Optional[_SshdSettings] = field(default=None, repr=False)
    #: Network namespace the listener runs in (NetnsLab), or None for the root namespace.
    netns: Optional[str] = field(default=None, repr=False)
    #: This host's private registry folder (``private_registry=True``), or None when the
    #: host shares the real REGISTRY_MOUNTPOINT with this machine.
    registry_dir: Optional[str] = field(default=None, repr=False)

    # -- introspection -----------------------------------------------------------------

    def session_pids(self) -> list[int]:
        """Pids of the per-connection sshd processes serving authenticated connections.

        These are the listener's children; killing one drops that client's connection
        the way a crashed or OOM-killed sshd would ("kill the sshd serving a host").
        Children still in the handshake (including the lab's own readiness probes) are
        left out, as are zombies.  For a root login the listed process is the parent of
        the session's command; with privilege separation there may be one more sshd
        process in between.
        """
        if self.sshd.poll() is not None:
            return []
        try:
            kids = psutil.Process(self.sshd.pid).children()
        except psutil.Error:
            return []
        pids = []
        for kid in kids:
            try:
                if kid.status() == psutil.STATUS_ZOMBIE:
                    continue
                title = " ".join(kid.cmdline())
            except psutil.Error:
                continue
            if not any(mark in title for mark in _UNAUTHENTICATED_TITLES):
                pids.append(kid.pid)
        return sorted(pids)

    @property
    def registry(self) -> str:
        """Where this host's rank wrappers keep their run records, as seen from the test."""
        return self.registry_dir or REGISTRY_MOUNTPOINT

    def log_text(self) -> str:
        """This host's sshd log (``sshd -e`` output, LogLevel VERBOSE)."""
        return Path(self.log_path).read_text(errors="replace")

    def known_hosts_line(self) -> str:
        """The known_hosts entry for this host's current key, for pre-seeding tests."""
        keytype, key = self.host_key_pub.split()[:2]
        return f"[{self.addr}]:{self.port} {keytype} {key}"

    # -- lifecycle ---------------------------------------------------------------------

    def _require_settings(self) -> _SshdSettings:
        if self._settings is None:
            raise LabError(f"{self.name} was not created by an SshdLab")
        return self._settings

    def _write_config(self) -> None:
        settings = self._require_settings()
        Path(self.config_path).write_text(
            _render_sshd_config(
                settings, self.name, self.addr, self.port, self.host_key_path, self.marker
            )
        )

    def _spawn(self) -> None:
        """Start the listener; its stderr (``-e``) is appended to the host's log."""
        self.sshd = _spawn_sshd(
            self._require_settings().sshd,
            self.config_path,
            self.log_path,
            netns=self.netns,
            registry_dir=self.registry_dir,
        )

    def restart(self) -> None:
        """Make the listener re-read its config and host key, keeping addr and port.

        A running listener gets SIGHUP, which is how sshd restarts in production: it
        re-execs itself in place (same pid), so established sessions stay its children
        and keep working, and ``stop()`` still finds them.  A stopped listener is started
        again.  Returns once the new listener answers with an SSH banner.
        """
        settings = self._require_settings()
        offset = os.path.getsize(self.log_path) if os.path.exists(self.log_path) else 0
        if self.sshd.poll() is None:
            self.sshd.send_signal(signal.SIGHUP)
        else:
            self._spawn()
        _wait_ready([self], settings.startup_timeout, log_offsets={self: offset})

    def regenerate_host_key(self) -> None:
        """Give this host a new ed25519 host key and restart its sshd on the same addr/port.

        For "host key changed" tests: clients that recorded the old key must now refuse to
        connect.  The new key is written under a temporary name and renamed into place so
        the running sshd never sees a half-written file.
        """
        self._require_settings()
        keygen = _find_keygen()
        if keygen is None:
            raise LabError("ssh-keygen not found: install openssh-client")
        key = Path(self.host_key_path)
        tmp = key.with_name(key.name + ".new")
        _generate_keys(keygen, [(tmp, f"fdl-lab-{self.name}")])
        os.replace(tmp.with_name(tmp.name + ".pub"), key.with_name(key.name + ".pub"))
        os.replace(tmp, key)
        self.host_key_pub = key.with_name(key.name + ".pub").read_text().strip()
        self.restart()

    def stop(self) -> None:
        """Stop this host's listener and every process descended from it, then wait.

        TERM, then KILL after the lab's grace period (2 s by default); session processes
        that escaped the tree (``setsid``, double fork) are found by their environment.
        """
        grace = self._settings.kill_grace if self._settings else 2.0
        _stop_hosts([self], grace)


#: Run inside the listener's new mount namespace: bind the host's private registry over
#: REGISTRY_MOUNTPOINT, then become sshd (same pid all the way: unshare and sh exec).
_BIND_REGISTRY = 'mount --bind -- "$1" "$2" || exit 97; shift 2; exec "$@"'


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
        for host in list(pending):
            rc = host.sshd.poll()
            if rc is not None:
                log = log_tail(host.log_path)
                if bind_failures is not None and (
                    "Address already in use" in log or "Cannot bind any address" in log
                ):
                    bind_failures.append(host)
                    pending.remove(host)
                    continue
                raise LabError(
                    f"sshd for {host.name} ({host.addr}:{host.port}) exited with {rc} "
                    f"during startup; log {host.log_path}:\n{log}"
                )
            if log_offsets is not None and host in log_offsets:
                with open(host.log_path, "rb") as fh:
                    fh.seek(log_offsets[host])
                    fresh = fh.read()
                if f"Server listening on {host.addr} port {host.port}".encode() not in fresh:
                    continue
            if _read_banner(host.addr, host.port):
                pending.remove(host)
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


def _probe_children(host: LabHost) -> bool:
    """True while the listener has unauthenticated (e.g. probe) children alive."""
    if host.sshd.poll() is not None:
        return False
    try:
        kids = psutil.Process(host.sshd.pid).children()
    except psutil.Error:
        return False
    return len(kids) > len(host.session_pids())


class SshdLab:
    """N lab hosts sharing one user key, one authorized_keys and one known_hosts.

    Everything lives under ``root``: ``hostkeys/``, ``hosts/<name>/`` (each host's working
    folder), ``<name>.sshd_config``, ``<name>.log``, ``id_ed25519`` and ``known_hosts``.
    ``known_hosts`` starts empty on purpose, so tests exercise ``accept-new``.

    Extra keyword arguments beyond the core ones: ``base_addr`` pins the first host's
    address (e.g. "127.0.0.2") instead of a random one; ``extra_sshd_config`` appends
    lines to every sshd_config (e.g. ``["MaxStartups 100"]``; a second SetEnv line would
    be ignored by sshd); ``startup_timeout`` and ``kill_grace`` tune start and stop.
    ``private_registry=True`` gives every host a run registry of its own (root only; see
    REGISTRY_MOUNTPOINT and ``LabHost.registry``); ``client_alive_interval`` and
    ``client_alive_count_max`` set sshd's ClientAlive* (how soon sshd drops a silent client).
    """

    def __init__(
        self,
        root: Union[str, os.PathLike[str]],
        n_hosts: int = 2,
        *,
        name_prefix: str = "lab",
        max_sessions: Optional[int] = None,
        login_shell_rc: Optional[str] = None,
        base_addr: Optional[str] = None,
        extra_sshd_config: Sequence[str] = (),
        startup_timeout: float = 10.0,
        kill_grace: float = 2.0,
        private_registry: bool = False,
        client_alive_interval: int = 5,
        client_alive_count_max: int = 3,
    ) -> None:
        """Prepare (but do not start) a lab; see ``start()``.

        ``login_shell_rc`` is shell *source text* (e.g. ``"sleep 2"``) that every session's
        bash runs before the command, after the user's real ~/.bashrc: a way to simulate
        slow or noisy dotfiles without touching the real ones.  It needs bash as the
        user's login shell (ValueError otherwise); see ``_write_login_rc`` for how.
        """
        self.root = Path(os.path.abspath(root))
        if re.search(r'[\s"%\'\\]', str(self.root)):
            # sshd_config and ``ssh -o`` values would need quoting/escaping; refuse
            # rather than produce configs that break in confusing ways.
            raise ValueError(f"lab root must not contain whitespace, quotes or %: {self.root}")
        if n_hosts < 1:
            raise ValueError("n_hosts must be at least 1")
        self.n_hosts = n_hosts
        self.name_prefix = name_prefix
        self.max_sessions = max_sessions
        self.login_shell_rc = login_shell_rc
        self.user = getpass.getuser()
        try:
            entry = pwd.getpwnam(self.user)
            self._home, shell = entry.pw_dir, entry.pw_shell
        except KeyError:
            self._home, shell = os.path.expanduser("~"), os.environ.get("SHELL", "")
        if login_shell_rc is not None and os.path.basename(shell) != "bash":
            raise ValueError(
                f"login_shell_rc needs bash as {self.user}'s login shell, not {shell!r}"
            )
        self.base_addr = base_addr
        self.extra_sshd_config = tuple(extra_sshd_config)
        self.startup_timeout = startup_timeout
        self.kill_grace = kill_grace
        self.private_registry = private_registry
        self.client_alive_interval = client_alive_interval
        self.client_alive_count_max = client_alive_count_max
        self.hosts: list[LabHost] = []
        self.identity_file = str(self.root / "id_ed25519")
        self.known_hosts = str(self.root / "known_hosts")
        self.authorized_keys = str(self.root / "authorized_keys")
        #: Distinguishes this lab's sessions from any other lab's in MARKER_ENV.
        self.lab_id = secrets.token_hex(6)

    # -- lifecycle ---------------------------------------------------------------------

    def start(self) -> SshdLab:
        """Generate keys, write configs, start every sshd in parallel, wait until all answer.

        On failure everything already started is stopped before the error propagates.
        """
        if self.hosts:
            return self
        sshd, keygen = _find_sshd(), _find_keygen()
        if sshd is None or keygen is None:
            raise LabError(
                "the sshd lab needs OpenSSH's sshd and ssh-keygen: install openssh-server"
            )
        stop_at_exit(self)
        try:
            self._start(sshd, keygen)
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self, sshd: str, keygen: str) -> None:
        _ensure_privsep_dir()
        (self.root / "hostkeys").mkdir(parents=True, exist_ok=True)
        (self.root / "hosts").mkdir(parents=True, exist_ok=True)
        names = [f"{self.name_prefix}{i + 1}" for i in range(self.n_hosts)]
        key_dir = self.root / "hostkeys"
        _generate_keys(
            keygen,
            [(Path(self.identity_file), f"fdl-lab-user-{self.lab_id}")]
            + [(key_dir / f"{name}_ed25519", f"fdl-lab-{name}") for name in names],
        )
        Path(self.authorized_keys).write_text(Path(self.identity_file + ".pub").read_text())
        Path(self.known_hosts).write_text("")

        session_env: tuple[str, ...] = ()
        if self.login_shell_rc is not None:
            session_env = _write_login_rc(self.root, self.login_shell_rc, self._home)
        settings = _SshdSettings(
            sshd=sshd,
            root=self.root,
            authorized_keys=self.authorized_keys,
            max_sessions=self.max_sessions,
            session_env=session_env,
            extra=self.extra_sshd_config,
            startup_timeout=self.startup_timeout,
            kill_grace=self.kill_grace,
            client_alive_interval=self.client_alive_interval,
            client_alive_count_max=self.client_alive_count_max,
        )
        if self.private_registry:
            _ensure_registry_mountpoint()

        for name, addr in zip(names, self._host_addresses(names)):
            host_path = self.root / "hosts" / name
            host_path.mkdir(parents=True, exist_ok=True)
            key = key_dir / f"{name}_ed25519"
            port = self._host_port(addr)
            registry: Optional[str] = None
            if self.private_registry:
                registry = str(self.root / "registry" / name)
                os.makedirs(registry, mode=0o700, exist_ok=True)
                os.chmod(registry, 0o700)
            netns = self._host_netns(name)
            config = str(self.root / f"{name}.sshd_config")
            log = str(self.root / f"{name}.log")
            marker = f"{self.lab_id}:{name}"
            Path(config).write_text(
                _render_sshd_config(settings, name, addr, port, str(key), marker)
            )
            self.hosts.append(
                LabHost(
                    name=name,
                    addr=addr,
                    port=port,
                    path=str(host_path),
                    sshd=_spawn_sshd(sshd, config, log, netns=netns, registry_dir=registry),
                    host_key_pub=key.with_name(key.name + ".pub").read_text().strip(),
                    host_key_path=str(key),
                    config_path=config,
                    log_path=log,
                    marker=marker,
                    _settings=settings,
                    netns=netns,
                    registry_dir=registry,
                )
            )

        pending = list(self.hosts)
        for attempt in range(3):
            retry: list[LabHost] = []
            _wait_ready(pending, self.startup_timeout, bind_failures=retry)
            if not retry:
                return
            if attempt == 2:
                raise LabError(
                    "sshd could not bind a port: "
                    + "; ".join(f"{h.name} log:\n{log_tail(h.log_path)}" for h in retry)
                )
            for host in retry:  # lost the race for the port probed by free_port
                host.port = self._host_port(host.addr)
                host._write_config()
                host._spawn()
            pending = retry

    # -- per-host hooks (NetnsLab overrides them) -------------------------------------

    def _host_addresses(self, names: Sequence[str]) -> list[str]:
        """One listen address per host name."""
        return _pick_addresses(len(names), self.base_addr)

    def _host_port(self, addr: str) -> int:
        return free_port(addr)

    def _host_netns(self, name: str) -> Optional[str]:
        return None

    def stop(self) -> None:
        """Stop every listener and all their descendants, plus escaped session processes.

        Only processes the lab started are touched: descendants of its listeners and
        processes whose environment carries this lab's session marker.  Idempotent.
        """
        _stop_hosts(self.hosts, self.kill_grace)
        _clear_stale_pyenv_lock()
        stopped(self)

    def __enter__(self) -> SshdLab:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # -- client-side helpers -----------------------------------------------------------

    def host(self, name: str) -> LabHost:
        """The host called ``name``."""
        for host in self.hosts:
            if host.name == name:
                return host
        raise KeyError(name)

    def ssh_options(self) -> list[str]:
        """OpenSSH ``-o`` options every lab client needs.

        A private known_hosts keeps the user's ~/.ssh/known_hosts out of the tests, and
        ``accept-new`` is what a first contact with a fresh cluster looks like.
        """
        return [f"UserKnownHostsFile={self.known_hosts}", "StrictHostKeyChecking=accept-new"]

    def worker(self, host: LabHost, **fields: Any) -> dict[str, Any]:
        """A cluster.yml worker mapping for ``host``, overridden by ``fields``.

        ``nproc`` defaults to 2 unless ``local_devices`` is given (the two are alternative
        ways to size a worker).  An ``ssh`` mapping in ``fields`` is merged key by key into
        the generated one, so ``worker(h, ssh={"port": 1})`` keeps the other ssh keys.
        """
        ssh: dict[str, Any] = {
            "target": host.addr,
            "port": host.port,
            "user": self.user,
            "identity_file": self.identity_file,
            "options": self.ssh_options(),
        }
        extra_ssh = fields.pop("ssh", None)
        if extra_ssh:
            ssh.update(extra_ssh)
        worker: dict[str, Any] = {"host": host.name, "path": host.path}
        if "local_devices" not in fields:
            worker["nproc"] = 2
        worker["ssh"] = ssh
        worker.update(fields)
        return worker

    def write_cluster(
        self, workers: list[dict[str, Any]], *, filename: str = "cluster.yml", **top: Any
    ) -> Path:
        """Write ``<root>/<filename>`` for ``workers`` and return its path.

        The controller gets a port that is free right now on 127.0.0.1, so concurrent
        tests do not fight over a fixed one.  ``top`` adds or overrides top-level keys.
        """
        doc: dict[str, Any] = {
            "controller": {"host": "127.0.0.1", "port": free_port("127.0.0.1")},
            "kill_grace": 2,
            **top,
            "workers": workers,
        }
        path = self.root / filename
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(doc, sort_keys=False, default_flow_style=False))
        return path

    def ssh_argv(self, host: LabHost, command: str) -> list[str]:
        """An OpenSSH client command line running ``command`` on ``host``.

        ``-F /dev/null`` keeps the user's and the system's ssh_config (ControlMaster,
        HashKnownHosts, SendEnv...) out of benchmarks and tests; BatchMode makes a
        failed login an error instead of a password prompt.
        """
        ssh = shutil.which("ssh") or "ssh"
        argv = [ssh, "-F", "/dev/null", "-T", "-i", self.identity_file, "-p", str(host.port)]
        argv += ["-l", self.user, "-o", "BatchMode=yes", "-o", "IdentitiesOnly=yes"]
        for option in [*self.ssh_options(), "ConnectTimeout=10", "LogLevel=ERROR"]:
            argv += ["-o", option]
        return [*argv, host.addr, command]



