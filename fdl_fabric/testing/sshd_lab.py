"""The sshd lab (``SshdLab``): N hosts started and stopped together, and their clients.

Why a module of its own: the lab is what tests and benchmarks hold.  It lays out the
lab folder, generates the shared user key and every host key, picks loopback addresses
and ports, starts all listeners in parallel (retrying hosts that lost a port race),
stops them all, and writes what a client needs: ssh options and argv, cluster.yml
workers and the cluster file.  ``NetnsLab`` subclasses it and overrides the per-host
hooks (address, port, network namespace).
"""

from __future__ import annotations

import getpass
import ipaddress
import os
import pwd
import random
import re
import secrets
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Optional, Union

import yaml

from .processes import LabError, free_port, log_tail, master_port, stop_at_exit, stopped
from .sshd_config import _render_sshd_config, _SshdSettings
from .sshd_host import LabHost
from .sshd_login import _clear_stale_pyenv_lock, _write_login_rc
from .sshd_process import _spawn_sshd, _stop_hosts, _wait_ready
from .sshd_registry import _ensure_registry_mountpoint
from .sshd_tools import _ensure_privsep_dir, _find_keygen, _find_sshd, _generate_keys


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
        session_env: Optional[Mapping[str, str]] = None,
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
        #: ``NAME=value`` every session gets (sshd ``SetEnv``): a test's own records
        #: folder for an fdl-fabric run there, for one.
        self.session_env = dict(session_env or {})
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
        session_env += tuple(f"{k}={v}" for k, v in self.session_env.items())
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

    def write_ssh_config(self, path: Path, alias: str = "node{i}") -> Path:
        """An ssh_config (``ssh -F``) naming each host by an alias only it knows
        (``node1``, ``node2``, ... by default: no resolver has them), with its address,
        port, user, key and the lab's known_hosts."""
        options = "".join(f"  {o.replace('=', ' ', 1)}\n" for o in self.ssh_options())
        path.write_text("\n".join(
            f"Host {alias.format(i=i)}\n  HostName {h.addr}\n  Port {h.port}\n"
            f"  User {self.user}\n  IdentityFile {self.identity_file}\n{options}"
            for i, h in enumerate(self.hosts, 1)))
        return path

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

        The controller gets a port that is free right now on 127.0.0.1, and
        ``master_port`` (torch's store) this test worker's (`processes.master_port`), so
        concurrent tests do not fight over a fixed one.  ``top`` adds or overrides
        top-level keys.
        """
        doc: dict[str, Any] = {
            "controller": {"host": "127.0.0.1", "port": free_port("127.0.0.1")},
            "master_port": master_port(),
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
