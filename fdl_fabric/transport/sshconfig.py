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
from typing import Optional

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


def resolve_settings(worker: WorkerSpec) -> SshSettings:
    """Merge a worker's ``ssh`` block, its options and our defaults.

    Precedence: the explicit ``ssh.target/user/port/identity_file`` fields,
    then user options, then our defaults; whatever is still unset comes from
    ``~/.ssh/config`` through Fabric (HostName, User, Port, IdentityFile,
    ProxyJump for Host aliases).
    """
    spec = worker.ssh
    _check_spec_names(worker)
    opts = {**DEFAULT_OPTIONS, **_from_config_file(spec.config_file, worker.host),
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
        forward_agent=(opts["forwardagent"].lower() == "yes") if "forwardagent" in opts
        else None,
    )


#: What an ``ssh -F`` file may set that the launcher applies itself (the rest, HostName,
#: User, Port, IdentityFile, ProxyJump, Fabric reads from the same file when connecting).
_FROM_CONFIG_FILE = ("stricthostkeychecking", "userknownhostsfile", "connecttimeout",
                     "serveraliveinterval", "serveralivecountmax", "batchmode", "port",
                     "hostname", "user", "identityfile", "proxyjump")


def _from_config_file(path: Optional[str], host: str) -> dict[str, str]:
    """The options an ``ssh -F`` file gives ``host``, as ssh would read them (first
    match wins); a file that cannot be read is an error naming it."""
    if path is None:
        return {}
    import paramiko  # only for an -F file: a local-only launch loads no SSH library

    try:
        found = paramiko.SSHConfig.from_path(path).lookup(host)
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


def hostname_of(host: str, config_file: Optional[str]) -> str:
    """The name ssh dials for ``host``, as ``ssh -G`` reads it: the ``HostName`` of the
    ``-F`` file (``ssh.config_file``), else of ``~/.ssh/config``; ``host`` itself when
    neither has one. A ``Host`` alias exists only for ssh: a rank given it as MASTER_ADDR
    cannot resolve it."""
    path = config_file or os.path.expanduser("~/.ssh/config")
    if not os.path.isfile(path):
        return host
    import paramiko  # only for a file that may say it: a local-only launch loads none

    try:
        found = paramiko.SSHConfig.from_path(path).lookup(host).get("hostname", host)
    except OSError as exc:
        raise SshOptionError(f"ssh config {path}: {exc.strerror or exc}") from None
    return str(found)


def with_dialable_addrs(cluster: ClusterSpec) -> ClusterSpec:
    """The cluster with each SSH worker whose ``addr`` is its ssh destination (the
    default) given the name ssh really dials (`hostname_of`), so MASTER_ADDR and the
    peers' addresses are names the ranks resolve; an ``addr`` written apart is kept."""
    import dataclasses

    workers = []
    for w in cluster.workers:
        dest = (w.ssh.target or w.host).rpartition("@")[2]
        if kind_name(w) == SSH and w.addr == dest:
            try:
                w = dataclasses.replace(w, addr=hostname_of(dest, w.ssh.config_file))
            except SshOptionError as exc:
                raise ConfigError([Problem(cluster.file, f"workers[{w.index}].ssh", w.line,
                                           str(exc))]) from None
        workers.append(w)
    return dataclasses.replace(cluster, workers=tuple(workers))


def resolve_all_settings(
    cluster: ClusterSpec, events: Optional[EventBus] = None
) -> dict[str, SshSettings]:
    """Every remote worker's SSH settings; a bad option is a ConfigError (exit 2)."""
    settings: dict[str, SshSettings] = {}
    problems: list[Problem] = []
    for w in cluster.workers:
        if kind_name(w) != SSH:  # only an SSH worker has SSH settings
            continue
        option = batchmode_off(w.ssh.options)
        if option and events is not None:
            events(Name.BATCHMODE_OFF, host=w.host, option=option)
        try:
            settings[w.host] = resolve_settings(w)
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
