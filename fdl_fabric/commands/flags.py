"""Command-line values: each flag checked before anything happens, each error naming it.

A flag that is wrong must stop the command before any output, file, connection or
process, with exit 2 and a message that names the flag (``--kill-grace: expected a
number of seconds, got 'abc'``), not a traceback and not a late failure after hosts
were contacted. invoke hands tasks strings (or booleans), so the tasks convert them
here.
"""

from __future__ import annotations

import math
import os
import re
import socket
import tempfile
from pathlib import Path
from typing import Any, Optional, Union

from ..agent.wire import AGENT_TIMEOUT_MIN
from ..clusterfile import ClusterSpec, parse_max_failure
from ..clusterfile.hosts import HostsError, cluster_from_hosts, expand_hosts, read_hostfile
from ..clusterfile.model import FANOUT_MAX
from ..errors import EXIT_USAGE, FdlError, usage
from ..limits import COMMAND_MAX_BYTES, RANKS_PER_WORKER_MAX, RESTARTS_MAX, SECONDS_MAX
from ..supervision.policy import MaxFailure
from ..transport.base import launcher_address
from .trusted import untrusted


def verbosity(value: Union[None, bool, str, int]) -> int:
    """``-v`` -> 1, ``-vv`` -> 2, ``--verbose=N`` -> N; the console's level is 1 + this.

    invoke gives an optional-value flag as True (``-v``), the rest of a short flag
    cluster as its value (``-vv`` -> ``"v"``), or the value (``--verbose=2``).
    """
    if value is None or value is False:
        return 0
    if value is True:
        return 1
    if isinstance(value, int):
        count = value
    elif value and set(value) == {"v"}:
        count = len(value) + 1
    elif value.isascii() and value.isdigit():
        count = int(value)
    else:
        raise usage("--verbose", f"expected -v, -vv or a level such as --verbose=2, got "
                    f"{value!r}")
    if count > 3:
        raise usage("--verbose", f"the highest level is 3, got {count}")
    return count


def seconds(flag: str, text: Optional[str]) -> Optional[float]:
    """A finite number of seconds >= 0 (``nan``, ``inf`` and ``-1`` are refused)."""
    if text is None:
        return None
    try:
        # float() takes any script's digits ('٣' is 3.0); a number here is ASCII, as for
        # every other flag.
        if not str(text).isascii():
            raise ValueError(text)
        value = float(str(text).strip())
    except ValueError:
        raise usage(flag, f"expected a number of seconds, got {text!r}") from None
    if not math.isfinite(value) or value < 0 or value > SECONDS_MAX:
        raise usage(flag, f"expected a number of seconds from 0 to {SECONDS_MAX:g}, got "
                    f"{text!r}")
    return value


def agent_timeout(text: Optional[str]) -> Optional[float]:
    """``--agent-timeout``: seconds, at least `wire.AGENT_TIMEOUT_MIN`."""
    value = seconds("--agent-timeout", text)
    if value is not None and value < AGENT_TIMEOUT_MIN:
        raise usage("--agent-timeout", f"must be at least {AGENT_TIMEOUT_MIN:g} seconds (agents "
                    f"send a heartbeat every second), got {text!r}")
    return value


def restarts(flag: str, text: Union[None, str, int]) -> Optional[int]:
    if text is None:
        return None
    raw = str(text).strip()
    if not (raw.isascii() and raw.isdigit()) or int(raw) > RESTARTS_MAX:
        raise usage(flag, f"expected a whole number from 0 to {RESTARTS_MAX}, got {text!r}")
    return int(raw)


def fanout(value: Optional[str]) -> Optional[int]:
    """``--fanout``: hosts the launcher reaches directly; beyond it, a gateway tree
    (`planning.tree`). The file's ``fanout:`` bound, 1 to `FANOUT_MAX`."""
    if value is None:
        return None
    text = str(value).strip()
    if not (text.isascii() and text.isdigit()) or not 1 <= int(text) <= FANOUT_MAX:
        raise usage("--fanout", f"expected a whole number from 1 to {FANOUT_MAX}, got {value!r}")
    return int(text)


def nproc_per_node(flag: str, value: Optional[str]) -> Optional[int]:
    """Ranks on each node or host: a whole number up to `RANKS_PER_WORKER_MAX`, the same
    bound as a worker's ``nproc`` in the cluster file; None when not given."""
    if value is None:
        return None
    text = str(value).strip()
    if not (text.isascii() and text.isdigit()) or not 1 <= int(text) <= RANKS_PER_WORKER_MAX:
        raise usage(flag, f"expected a number of ranks per node, 1-{RANKS_PER_WORKER_MAX}, "
                    f"got {value!r}")
    return int(text)


def max_failure(text: Optional[str]) -> Optional[MaxFailure]:
    """``--max-failure``: a count or a percentage, parsed by the cluster file's own rule;
    None when the flag is not given (the file's ``elastic.max_failure`` then applies)."""
    if text is None:
        return None
    try:
        return parse_max_failure(text)
    except ValueError as exc:
        raise usage("--max-failure", str(exc)) from None


def cluster_file(value: Optional[str], default: str) -> str:
    if value is None:
        return default
    if not value.strip():
        raise usage("--cluster", "is empty (give a cluster file, or leave the flag out for "
                    f"{default})")
    return value


def command(text: Optional[str]) -> Optional[str]:
    if text is None:
        return None
    if not text.strip():
        raise usage("--cmd", "the command is empty")
    if len(text.encode("utf-8", "surrogatepass")) > COMMAND_MAX_BYTES:
        raise usage("--cmd", f"the command is longer than {COMMAND_MAX_BYTES} bytes")
    return text


def log_dir(path: Optional[str]) -> Optional[str]:
    """A folder that exists or can be created, and can be written; nothing is left behind."""
    if path is None:
        return None
    if not path.strip():
        raise usage("--log-dir", "is empty")
    target = Path(path)
    missing: list[Path] = []
    probe = target
    while not probe.exists():
        missing.append(probe)
        if probe.parent == probe:
            break
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        raise usage("--log-dir", f"{probe} is not a folder")
    why = untrusted(path)
    if why is not None:
        raise usage("--log-dir", f"{why}: another user could redirect the run's logs "
                    "(use a folder only you can write)")
    try:
        if missing:
            os.makedirs(target)
        tempfile.TemporaryDirectory(dir=target).cleanup()
    except OSError as exc:
        raise usage("--log-dir", f"cannot create or write {path}: "
                    f"{exc.strerror or exc}") from None
    finally:
        for folder in missing:  # leaf first: only what this check created
            try:
                folder.rmdir()
            except OSError:
                break
    return path


def pattern(text: Optional[str]) -> Optional[str]:
    """cleanup's ``--pattern``: a regular expression, checked here rather than by every
    host's agent after the connections are made."""
    if text is None:
        return None
    try:
        re.compile(text)
    except re.error as exc:
        raise usage("--pattern", f"not a regular expression: {exc}") from None
    return text


def hosts_cluster(hosts: Optional[str], hostfile: Optional[str], ssh_config: Optional[str],
                  nproc_per_node: Optional[int], *, cluster_given: bool,
                  **top: Any) -> Optional[ClusterSpec]:
    """``--hosts`` / ``--hostfile`` (with ``-F``): the cluster they stand for, or None when
    neither is given. Checked like a cluster file (exit 2, the flag or line named)."""
    if hosts is None and hostfile is None:
        if ssh_config is not None:
            raise usage("--ssh-config", "only with --hosts or --hostfile (a cluster file "
                        "sets ssh.config_file per worker)")
        return None
    if hosts is not None and hostfile is not None:
        raise usage("--hosts", "give --hosts or --hostfile, not both")
    if cluster_given:
        raise usage("--hosts" if hosts is not None else "--hostfile",
                    "the hosts come from the command line or from --cluster, not both")
    if ssh_config is not None and not os.path.isfile(ssh_config):
        raise usage("--ssh-config", f"{ssh_config} is not a file")
    try:
        slots = expand_hosts(hosts) if hosts is not None else read_hostfile(str(hostfile))
        source = "--hosts" if hosts is not None else str(hostfile)
        # Every host is checked before the first one is looked up (a name lookup is the
        # first thing that leaves this machine).
        cluster = cluster_from_hosts(slots, nproc_per_node=nproc_per_node,
                                     ssh_config=ssh_config, source=source, **top)
        controller = None if "controller" in top else \
            _controller_toward(slots[0].host, ssh_config)
        if controller is None:
            return cluster
        return cluster_from_hosts(slots, nproc_per_node=nproc_per_node, ssh_config=ssh_config,
                                  source=source, controller={"host": controller}, **top)
    except HostsError as exc:
        raise FdlError(str(exc), EXIT_USAGE) from None


def _controller_toward(host: str, ssh_config: Optional[str]) -> Optional[str]:
    """The address of this machine that the first host sees (what its ranks dial), for a
    remote first host; None for this machine (the coordinator then binds loopback)."""
    if host in ("localhost", "127.0.0.1"):
        return None
    target = host
    if ssh_config is not None:
        import paramiko  # only with -F: a local launch loads no SSH library

        target = str(paramiko.SSHConfig.from_path(ssh_config).lookup(host).get("hostname", host))
    try:
        return launcher_address(target)
    except UnicodeError:  # a name the IDNA codec refuses: as for a name that does not resolve
        return socket.gethostname()

