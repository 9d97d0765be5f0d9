"""SSH settings from cluster.yml: OpenSSH options mapped onto what we use, no connection.

Users describe SSH the way they know it, as OpenSSH ``Key=Value`` options; this module
maps the options we support onto one `SshSettings` per remote worker and refuses the
rest (silently ignoring an option the user relies on is worse than an error). Defaults
follow the flodl launcher: no prompts, keepalive 10 s x 3, connect timeout 10 s, and
host keys with ``accept-new`` semantics. It imports no SSH library, so a launch with
only local workers never loads paramiko; `fdl_fabric.transport.ssh` connects with these settings.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

from ..clusterfile import ClusterSpec, ConfigError, Problem, WorkerSpec, load_cluster
from ..clusterfile.names import (
    host_name_problem,
    single_line_problem,
    ssh_option_value_problem,
    ssh_target_problem,
    user_name_problem,
)
from ..events import EventBus, Name
from ..limits import PORT_MAX
from .configtrust import HOW_TO_ALLOW, directives_in, named_by_file, refuse_commands
from .kinds import SSH, kind_name

#: OpenSSH options we understand, by lowercase name.
SUPPORTED_OPTIONS = {
    "stricthostkeychecking": "StrictHostKeyChecking",
    "userknownhostsfile": "UserKnownHostsFile",
    "connecttimeout": "ConnectTimeout",
    "serveraliveinterval": "ServerAliveInterval",
    "serveralivecountmax": "ServerAliveCountMax",
    "proxyjump": "ProxyJump",
    "identityfile": "IdentityFile",
    "user": "User",
    "port": "Port",
    "batchmode": "BatchMode",
    "hostname": "HostName",
    "forwardagent": "ForwardAgent",
}

#: Our defaults; user options override them.
DEFAULT_OPTIONS = {
    "stricthostkeychecking": "accept-new",
    "connecttimeout": "10",
    "serveraliveinterval": "10",
    "serveralivecountmax": "3",
    "batchmode": "yes",
}

#: known_hosts when nothing else is configured, as for OpenSSH.
DEFAULT_KNOWN_HOSTS = "~/.ssh/known_hosts"



class SshOptionError(ValueError):
    """An ``ssh.options`` entry we cannot honour; the message names it."""


@dataclass(frozen=True)
class SshSettings:
    """Everything needed to open one host's Connection, resolved."""

    host: str
    target: str
    user: Optional[str]
    port: Optional[int]
    identity_files: tuple[str, ...]
    strict_host_key_checking: str
    known_hosts_file: str
    connect_timeout: float
    alive_interval: float
    alive_count_max: int
    proxy_jump: Optional[str]
    batch_mode: bool
    #: ``ssh -F``: the ssh_config Fabric reads instead of ``~/.ssh/config``.
    config_file: Optional[str] = None
    #: ``ForwardAgent=yes|no`` among the options; None: ssh_config decides (Fabric).
    #: A gateway needs it when its leaves' keys are in the controller's agent.
    forward_agent: Optional[bool] = None
    #: ``config_file`` is a cluster file's, not allowed to run commands: each reading
    #: of it is checked again (`read_config`).
    config_checked: bool = False
    #: The ``ProxyCommand`` the ``-F`` file gives the host (as ssh reads it for the name
    #: the worker gives, alias included), its ``%h``/``%p`` expanded; only ever set when
    #: the operator allowed that file to run commands, or it is their own.
    proxy_command: Optional[str] = None
    #: Seconds for the SSH handshake and login once connected (None: ``connect_timeout``):
    #: a host dialled again after a partition waits little for its SYN, as long as ever
    #: for its banner and login on a loaded machine (`SshTransport.redial`).
    handshake_timeout: Optional[float] = None

    @property
    def alive_timeout(self) -> float:
        """How long a silent connection is trusted before it is declared dead."""
        return self.alive_interval * max(1, self.alive_count_max)


def parse_options(options: Sequence[str]) -> dict[str, str]:
    """Lowercase option name to value; the first occurrence wins, as in OpenSSH.

    Values follow config's grammar (one line, a port in 1-65535, a host name for HostName,
    ...), the same one a cluster file is checked against, so options given in code cannot
    carry a second line ("...\\nProxyCommand ...") or a port 0 that paramiko reads as 22.
    """
    parsed: dict[str, str] = {}
    for raw in options:
        problem = single_line_problem(raw)
        if problem:
            raise SshOptionError(f"ssh option {_shown(raw)} {problem}")
        key, sep, value = raw.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key:
            raise SshOptionError(f"{_shown(raw)} is not of the form Key=Value")
        name = key.lower()
        if name not in SUPPORTED_OPTIONS:
            known = ", ".join(sorted(SUPPORTED_OPTIONS.values()))
            raise SshOptionError(
                f"ssh option {_shown(key)} is not supported (supported: {known})"
            )
        problem = ssh_option_value_problem(key, value)
        if problem:
            raise SshOptionError(problem)
        parsed.setdefault(name, value)
    return parsed


def _shown(text: str) -> str:
    """repr() of a user's text, shortened so an error stays one readable line."""
    return repr(text) if len(text) <= 60 else f"{text[:60]!r}... ({len(text)} characters)"


def batchmode_off(options: Sequence[str]) -> Optional[str]:
    """The option that turns BatchMode off, if one does: the seed warns about it
    (`Name.BATCHMODE_OFF`), and the option is still honoured."""
    for opt in options:
        key, sep, value = opt.partition("=")
        if sep and key.strip().lower() == "batchmode" and value.strip().lower() != "yes":
            return opt.strip()
    return None


def _number(name: str, value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise SshOptionError(f"{SUPPORTED_OPTIONS[name]}={value!r} must be a number") from None
    if not math.isfinite(number):  # float() takes "nan" and "inf"; no timeout can be either
        raise SshOptionError(f"{SUPPORTED_OPTIONS[name]}={value!r} must be a finite number")
    if number < 0:
        raise SshOptionError(f"{SUPPORTED_OPTIONS[name]}={value!r} must not be negative")
    return number


def _check_spec_names(worker: WorkerSpec) -> None:
    """The names ``resolve_settings`` hands to paramiko, held to config's grammar again: a
    WorkerSpec can be built in code, without the cluster file's checks."""
    spec = worker.ssh
    problems = [
        ("host", host_name_problem(worker.host)),
        ("ssh.target", spec.target and ssh_target_problem(spec.target)),
        ("ssh.user", spec.user and user_name_problem(spec.user)),
    ]
    for key, problem in problems:
        if problem:
            raise SshOptionError(f"{key}: {problem}")
    if spec.port is not None and not 1 <= spec.port <= PORT_MAX:
        raise SshOptionError(f"ssh.port: must be between 1 and {PORT_MAX}, got {spec.port}")


def _checked(cluster: ClusterSpec, worker: WorkerSpec) -> bool:
    """Whether ``worker``'s ssh_config is a cluster file's that may not run commands."""
    return named_by_file(cluster, worker) and not worker.ssh.commands_trusted


def resolve_settings(worker: WorkerSpec, *, checked: bool = False) -> SshSettings:
    """Merge a worker's ``ssh`` block, its options and our defaults.

    Precedence: the explicit ``ssh.target/user/port/identity_file`` fields,
    then user options, then our defaults; whatever is still unset comes from
    ``~/.ssh/config`` through Fabric (HostName, User, Port, IdentityFile,
    ProxyJump for Host aliases).
    """
    spec = worker.ssh
    _check_spec_names(worker)
    opts = {**DEFAULT_OPTIONS, **_from_config_file(spec.config_file, worker.host, checked),
            **parse_options(spec.options)}
    strict = opts["stricthostkeychecking"].lower()
    if strict == "off":
        strict = "no"
    if strict == "ask":
        strict = "yes"  # we never prompt; 'ask' without a prompt is 'yes'
    if strict not in ("yes", "no", "accept-new"):
        raise SshOptionError(
            f"StrictHostKeyChecking={opts['stricthostkeychecking']!r} must be one of "
            "yes, no, accept-new"
        )
    port: Optional[int] = spec.port
    if port is None and "port" in opts:
        port = int(opts["port"])  # parse_options made sure it is 1..65535
    identities = [spec.identity_file] if spec.identity_file else []
    if "identityfile" in opts:
        identities.append(os.path.expanduser(opts["identityfile"]))
    count_max = _number("serveralivecountmax", opts["serveralivecountmax"])
    return SshSettings(
        host=worker.host,
        target=spec.target or opts.get("hostname") or worker.host,
        user=spec.user or opts.get("user"),
        port=port,
        identity_files=tuple(identities),
        strict_host_key_checking=strict,
        known_hosts_file=os.path.expanduser(
            opts.get("userknownhostsfile", DEFAULT_KNOWN_HOSTS).split()[0]
        ),
        connect_timeout=_number("connecttimeout", opts["connecttimeout"]),
        alive_interval=_number("serveraliveinterval", opts["serveraliveinterval"]),
        alive_count_max=int(count_max),
        proxy_jump=opts.get("proxyjump") if opts.get("proxyjump", "none") != "none" else None,
        batch_mode=opts["batchmode"].lower() == "yes",
        config_file=spec.config_file,
        config_checked=checked,
        proxy_command=opts.get("proxycommand"),
        forward_agent=(opts["forwardagent"].lower() == "yes") if "forwardagent" in opts
        else None,
    )


#: What an ``ssh -F`` file may set that the launcher applies itself (the rest Fabric reads
#: from the same file when connecting, looking up the target). ``ProxyCommand`` is taken
#: for the worker's own name, as ssh would: Fabric, looking up the ``HostName``, misses
#: one written under a ``Host`` alias.
_FROM_CONFIG_FILE = ("stricthostkeychecking", "userknownhostsfile", "connecttimeout",
                     "serveraliveinterval", "serveralivecountmax", "batchmode", "port",
                     "hostname", "user", "identityfile", "proxyjump", "proxycommand")


def read_config(path: Optional[str], *, checked: bool = False) -> Any:
    """The ssh_config a lookup reads, as Fabric would: ``path`` alone (``ssh -F``), else
    ``~/.ssh/config`` then ``/etc/ssh/ssh_config``; parsed, nothing run. Its lookups run
    a ``Match exec`` only outside `configtrust.inert` (a dry run), so every ssh_config
    the launcher reads obeys that switch. OSError: ``path`` cannot be read.

    ``checked``: a cluster file's ssh_config the operator did not allow to run commands.
    The text parsed is the text checked, every time it is read, so a file changed after
    `configtrust.refuse_commands` looked at it runs nothing either: SshOptionError."""
    from .configread import parsed  # paramiko: only for a host over SSH

    paths = [path] if path is not None else [os.path.expanduser("~/.ssh/config"),
                                             "/etc/ssh/ssh_config"]
    texts = []
    for one in paths:
        if path is None and not os.path.isfile(one):
            continue
        with open(os.path.expanduser(one), encoding="utf-8") as fh:
            text = fh.read()
        found = directives_in(text, one) if checked else []
        if found:
            raise SshOptionError(f"{found[0]}; {HOW_TO_ALLOW}")
        texts.append(text)
    return parsed(texts)  # parsed once a process while the texts are the same


def _from_config_file(path: Optional[str], host: str, checked: bool) -> dict[str, str]:
    """The options an ``ssh -F`` file gives ``host``, as ssh would read them (first
    match wins); a file that cannot be read is an error naming it."""
    if path is None:
        return {}
    try:
        found = read_config(path, checked=checked).lookup(host)
    except OSError as exc:
        raise SshOptionError(f"ssh config {path}: {exc.strerror or exc}") from None
    out: dict[str, str] = {}
    for key in _FROM_CONFIG_FILE:
        value = found.get(key)
        if isinstance(value, list):
            value = value[0] if value else None
        if value is not None and (key != "hostname" or value != host):
            out[key] = os.path.expanduser(str(value)) if key in (
                "identityfile", "userknownhostsfile") else str(value)
    return out


def hostname_of(host: str, config_file: Optional[str], *, checked: bool = False) -> str:
    """The name ssh dials for ``host``, as ``ssh -G`` reads it: the ``HostName`` of the
    ``-F`` file (``ssh.config_file``), else of ``~/.ssh/config``; ``host`` itself when
    neither has one. A ``Host`` alias exists only for ssh: a rank given it as MASTER_ADDR
    cannot resolve it."""
    path = config_file or os.path.expanduser("~/.ssh/config")
    if not os.path.isfile(path):
        return host
    try:
        found = read_config(path, checked=checked).lookup(host).get("hostname", host)
    except OSError as exc:
        raise SshOptionError(f"ssh config {path}: {exc.strerror or exc}") from None
    return str(found)


def with_dialable_addrs(cluster: ClusterSpec) -> ClusterSpec:
    """The cluster with each SSH worker whose ``addr`` is its ssh destination (the
    default) given the name ssh really dials (`hostname_of`), so MASTER_ADDR and the
    peers' addresses are names the ranks resolve; an ``addr`` written apart is kept."""
    import dataclasses

    refuse_commands(cluster)  # before any lookup: a Match exec runs inside one
    workers = []
    for w in cluster.workers:
        dest = (w.ssh.target or w.host).rpartition("@")[2]
        if kind_name(w) == SSH and w.addr == dest:
            try:
                w = dataclasses.replace(w, addr=hostname_of(
                    dest, w.ssh.config_file, checked=_checked(cluster, w)))
            except SshOptionError as exc:
                raise ConfigError([Problem(cluster.file, f"workers[{w.index}].ssh", w.line,
                                           str(exc))]) from None
        workers.append(w)
    return dataclasses.replace(cluster, workers=tuple(workers))


def resolve_all_settings(
    cluster: ClusterSpec, events: Optional[EventBus] = None
) -> dict[str, SshSettings]:
    """Every remote worker's SSH settings; a bad option is a ConfigError (exit 2), and
    so is a cluster file's ssh_config that runs commands unallowed (`configtrust`)."""
    refuse_commands(cluster)
    settings: dict[str, SshSettings] = {}
    problems: list[Problem] = []
    for w in cluster.workers:
        if kind_name(w) != SSH:  # only an SSH worker has SSH settings
            continue
        option = batchmode_off(w.ssh.options)
        if option and events is not None:
            events(Name.BATCHMODE_OFF, host=w.host, option=option)
        try:
            settings[w.host] = resolve_settings(w, checked=_checked(cluster, w))
        except SshOptionError as exc:
            problems.append(Problem(cluster.file, f"workers[{w.index}].ssh.options", w.line,
                                    str(exc)))
    if problems:
        raise ConfigError(problems)
    return settings


def load_with_settings(
    cluster_file: str, events: Optional[EventBus] = None
) -> tuple[ClusterSpec, dict[str, SshSettings]]:
    """A cluster file and its remote workers' SSH settings: the two things that must hold
    before any host is contacted. Either failing is one ConfigError (exit 2)."""
    cluster = load_cluster(cluster_file)
    return cluster, resolve_all_settings(cluster, events)
