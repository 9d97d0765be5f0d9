"""One lab host (``LabHost``): what tests ask of a host and do to it.

Why a module of its own: a host is the unit that fault tests act on (kill the sshd
serving a session, restart the listener, change its host key, stop it) and that client
code looks at (address, port, known_hosts line, registry, log).  It keeps the shared
lab settings so it can rewrite its config and restart alone, without its ``SshdLab``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import psutil

from .processes import LabError
from .sshd_config import _render_sshd_config, _SshdSettings
from .sshd_process import _spawn_sshd, _stop_hosts, _wait_ready
from .sshd_registry import REGISTRY_MOUNTPOINT
from .sshd_tools import _find_keygen, _generate_keys

#: Process titles of per-connection sshd processes that have not authenticated anyone
#: yet (our own readiness probes, port scanners); these do not "serve a session".
_UNAUTHENTICATED_TITLES = ("[accepted]", "[preauth]", "[net]", "[listener]", " -R")


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

    def lose(self) -> None:
        """The host gone at once: its sshd and every session it served SIGKILLed, so its
        agent (and a gateway's relay) can report nothing more and its ranks are left to
        their watchdogs and leashes. Only this host's own processes, by pid."""
        sessions = self.session_pids()
        self.sshd.kill()
        self.sshd.wait()
        for pid in sessions:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

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
