"""Command-line values: each flag checked before anything happens, each error naming it.

A flag that is wrong must stop the command before any output, file, connection or
process, with exit 2 and a message that names the flag (``--kill-grace: expected a
number of seconds, got 'abc'``), not a traceback and not a late failure after hosts
were contacted. invoke hands tasks strings (or booleans), so the tasks convert them
here.
"""

from __future__ import annotations

import contextlib
import ipaddress
import math
import os
import re
import socket
import tempfile
from pathlib import Path
from typing import Optional, Union

from ..agent.wire import AGENT_TIMEOUT_MIN
from ..clusterfile import parse_max_failure
from ..clusterfile.hosts import (
    HostsError,
    HostSlot,
    SshDefaults,
    expand_hosts,
    port_number,
    read_hostfile,
)
from ..clusterfile.model import FANOUT_MAX
from ..clusterfile.names import command_problem, host_name_problem, path_problem, user_name_problem
from ..errors import EXIT_USAGE, FdlError, usage
from ..limits import COMMAND_MAX_BYTES, RANKS_PER_WORKER_MAX, RESTARTS_MAX, SECONDS_MAX
from .launchoptions import MaxFailure
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
    return whole(flag, text, RESTARTS_MAX)


def whole(flag: str, text: Union[None, str, int], maximum: int) -> Optional[int]:
    """A whole number from 0 to ``maximum`` (``--tail``, ``--rank``)."""
    if text is None:
        return None
    raw = str(text).strip()
    if not (raw.isascii() and raw.isdigit()) or int(raw) > maximum:
        raise usage(flag, f"expected a whole number from 0 to {maximum}, got {text!r}")
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


def command(text: Optional[str], flag: str = "--cmd") -> Optional[str]:
    """A shell command given as one string (``--cmd``, ``--on-exit``)."""
    if text is None:
        return None
    if not text.strip():
        raise usage(flag, "the command is empty")
    if "\0" in text:
        raise usage(flag, "the command contains a NUL character")
    if len(text.encode("utf-8", "surrogatepass")) > COMMAND_MAX_BYTES:
        raise usage(flag, f"the command is longer than {COMMAND_MAX_BYTES} bytes")
    return text


def on_exit(text: Optional[str]) -> Optional[str]:
    """``--on-exit``: a shell command, held to the rule of the file's ``on_exit:``."""
    command(text, "--on-exit")
    problem = command_problem(text) if text is not None else None
    if problem is not None:
        raise usage("--on-exit", f"the command {problem}")
    return text


def python(text: Optional[str]) -> Optional[str]:
    """``--python``: one interpreter, held to the rule of the file's ``python:``."""
    if text is None:
        return None
    if not text.strip() or any(c.isspace() for c in text):
        raise usage("--python", f"is one interpreter (a path or a name), got {text!r}")
    if text.startswith("~"):
        raise usage("--python", "~ is not expanded on the hosts: use a path relative to the "
                    "ranks' folder or an absolute one")
    problem = path_problem(text)
    if problem is not None:
        raise usage("--python", f"the path {problem}")
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


def nproc_words(value: Optional[str], *, this_machine: bool) -> Optional[int]:
    """``--nproc-per-node``: a number; for ``run`` also torchrun's ``gpu``, ``cpu`` and
    ``auto``, counted on this machine (torchrun counts on each node; ``--hosts`` assumes
    hosts like this one, and a cluster file's ``local_devices: all`` asks each host)."""
    if value is None:
        return None
    text = str(value).strip().lower()
    if this_machine and text in ("gpu", "cpu", "auto"):
        from ..agent.gpus import gpu_indices

        count = len(gpu_indices().get("gpus") or []) if text != "cpu" else 0
        if not count and text == "gpu":
            raise usage("--nproc-per-node", "gpu: no GPU found (nvidia-smi)")
        text = str(count or os.cpu_count() or 1)
    return nproc_per_node("--nproc-per-node", text)


def nnodes(text: str) -> tuple[int, int]:
    """torchrun's ``--nnodes N`` or ``MIN:MAX``."""
    low, _, high = text.strip().partition(":")
    high = high or low
    if not (low.isascii() and low.isdigit() and high.isascii() and high.isdigit()) \
            or not 1 <= int(low) <= int(high):
        raise usage("--nnodes", f"expected N or MIN:MAX with 1 <= MIN <= MAX, got {text!r}")
    return int(low), int(high)


def port(flag: str, value: Optional[str]) -> Optional[int]:
    """A TCP port, 1-65535."""
    if value is None:
        return None
    try:
        return port_number(str(value).strip(), flag)
    except HostsError as exc:
        raise FdlError(str(exc), EXIT_USAGE) from None


def address(flag: str, value: Optional[str]) -> Optional[str]:
    """A host name or an IP address (brackets around IPv6 dropped), by the cluster file's
    own rule for ``addr``."""
    if value is None:
        return None
    text = str(value).strip()
    if text.startswith("[") and text.endswith("]"):
        text = text[1:-1]
    problem = host_name_problem(text) if text else "is empty"
    if problem is not None:
        raise usage(flag, f"{text!r} {problem}" if not problem.startswith(repr(text))
                    else problem)
    return text


def endpoint(flag: str, value: str) -> tuple[str, int]:
    """torchrun's ``HOST:PORT`` (``[v6]:PORT``); a missing port is refused, not guessed."""
    text = str(value).strip()
    host, colon, port_text = text.rpartition(":")
    if not colon or not host or (":" in host and not host.startswith("[")):
        raise usage(flag, f"expected HOST:PORT (IPv6 as [addr]:PORT), got {value!r}")
    checked = address(flag, host)
    found = port(flag, port_text)
    assert checked is not None and found is not None
    return checked, found


def ssh_defaults(config_file: Optional[str], user: Optional[str], port_text: Optional[str],
                 identity: Optional[str]) -> SshDefaults:
    """``-F``, ``-l``, ``-p``, ``-i``: how every host of the command line is reached."""
    if config_file is not None and not os.path.isfile(config_file):
        raise usage("--ssh-config", f"{config_file} is not a file")
    if identity is not None and not os.path.isfile(os.path.expanduser(identity)):
        raise usage("--identity", f"{identity} is not a file (a private key, as ssh -i)")
    if user is not None:
        problem = user_name_problem(user)
        if problem is not None:
            raise usage("--user", f"{user!r} {problem}")
    return SshDefaults(config_file=config_file, user=user, port=port("--port", port_text),
                       identity_file=identity)


def host_slots(hosts: Optional[str], hostfile: Optional[str]) -> list[HostSlot]:
    """The hosts of ``--hosts`` or ``--hostfile``, each with its slots, user and port."""
    try:
        return expand_hosts(hosts) if hosts is not None else read_hostfile(str(hostfile))
    except HostsError as exc:
        raise FdlError(str(exc), EXIT_USAGE) from None


def dialed(host: str, config_file: Optional[str]) -> str:
    """The name ``host`` is dialled by (`transport.dialed_name`: an ssh_config alias's
    HostName), its error naming the flag."""
    from ..transport import dialed_name

    try:
        return dialed_name(host, config_file)
    except ValueError as exc:
        raise usage("--ssh-config", str(exc)) from None


def controller_toward(first_addr: str) -> Optional[str]:
    """The address of this machine that the first host sees (what its ranks dial), for a
    remote first host; None for this machine (the coordinator then binds loopback)."""
    if is_this_machine(first_addr):
        return None
    try:
        from ..transport.base import launcher_address  # only for --hosts

        return launcher_address(first_addr)
    except UnicodeError:  # a name the IDNA codec refuses: as for a name that does not resolve
        return socket.gethostname()


def is_this_machine(address_: str) -> bool:
    """A loopback name or address: the hosts that are this machine, as written."""
    if address_ == "localhost":
        return True
    try:
        return ipaddress.ip_address(address_).is_loopback
    except ValueError:
        return False


def free_ports(count: int) -> list[int]:
    """``count`` different ports nobody on this machine listens on now (the kernel's
    picks, all held until all are known: ports picked one after the other may be the
    same one twice, as each is free again once its socket closes)."""
    with contextlib.ExitStack() as held:
        ports = []
        for _ in range(count):
            s = held.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            s.bind(("", 0))
            ports.append(int(s.getsockname()[1]))
        return ports
