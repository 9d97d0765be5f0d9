"""Which ssh_config may run commands: a cluster file that names one is code.

An ssh_config can run programs on this machine, as the operator: ``Match exec`` while a
host is merely looked up (paramiko runs it inside `SSHConfig.lookup`), ``ProxyCommand``
when connecting, ``LocalCommand`` and ``KnownHostsCommand`` in OpenSSH (a gateway's
relay reaches its leaves with OpenSSH, ``-F`` that same file). The operator's own
ssh_config (``~/.ssh/config``, ``-F``/``--ssh-config``) is theirs to trust; one named
by a cluster file (``ssh.config_file``) comes with the file, from whoever wrote it (a
shared repository), so:

* before any lookup of a cluster file's ssh_config, its text is read for those
  directives (`config_problems`), and each is refused with its file, line and name
  unless the operator allowed it (``--trust-ssh-config``, or ``ssh.allow_commands:
  true`` in a cluster file the operator owns: `with_trust`);
* a dry run runs nothing from any ssh_config (`inert`): lookups inside it leave every
  ``Match exec`` unevaluated (its block is not applied) and it never connects, so no
  ``ProxyCommand`` starts either.

The switch for a dry run is a context variable, set once at its top, not a flag passed
down: a host is looked up from many places (the flags of ``--hosts``, the dialable
addresses, each host's settings, the Connection a description builds), and every one
reads its ssh_config through `sshconfig.read_config`, which asks `commands_may_run`.
This module imports no SSH library: a launch with only local workers still loads none.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Optional

from ..clusterfile import ClusterSpec, ConfigError, Problem, WorkerSpec
from .kinds import SSH, kind_name

#: Directives that run (or load) code on this machine or on a gateway, by lowercase
#: name: how they are written, and what they do, for the refusal.
COMMAND_DIRECTIVES = {
    "proxycommand": ("ProxyCommand", "runs a command"),
    "localcommand": ("LocalCommand", "runs a command"),
    "knownhostscommand": ("KnownHostsCommand", "runs a command"),
    "pkcs11provider": ("PKCS11Provider", "loads a library"),
    "securitykeyprovider": ("SecurityKeyProvider", "loads a library"),
    # paramiko ignores Include; the OpenSSH of a gateway reads the included files, which
    # this check never sees.
    "include": ("Include", "reads files this check does not see"),
}
#: ``Match ... exec "cmd"``: the criterion that runs a command during a lookup.
MATCH_EXEC = ("Match exec", "runs a command")

#: How to allow it, said in every refusal.
HOW_TO_ALLOW = ("a cluster file's ssh_config may not run commands unless you allow it "
                "(--trust-ssh-config, or ssh.allow_commands: true in a file you own)")

# ssh_config's grammar, as paramiko reads it: ``Key value`` or ``Key=value``.
_SETTING = re.compile(r"(\w+)(?:\s*=\s*|\s+)(.+)")
# ``exec`` as a word of a Match line, however quoted or negated (``"exec"``, ``!exec``,
# ``exec=...``); a host pattern such as ``exec-box`` is not it. Erring toward refusing.
_EXEC_WORD = re.compile(r"(?<![\w.-])exec(?![\w.-])", re.IGNORECASE)

#: False while nothing from an ssh_config may run (a dry run): see `inert`.
_may_run: ContextVar[bool] = ContextVar("fdl_ssh_config_commands", default=True)


@contextlib.contextmanager
def inert() -> Iterator[None]:
    """Within: no ssh_config read through `sshconfig.read_config` runs anything (a
    ``Match exec`` is left unevaluated, its block not applied). A dry run's promise."""
    token = _may_run.set(False)
    try:
        yield
    finally:
        _may_run.reset(token)


def commands_may_run() -> bool:
    """False inside `inert`."""
    return _may_run.get()


@dataclass(frozen=True)
class Directive:
    """One line of an ssh_config that runs (or loads) something."""

    path: str
    line: int
    name: str
    does: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.name} {self.does}"


def command_directives(path: str) -> list[Directive]:
    """Every line of the ssh_config at ``path`` that runs or loads something, in order
    (`directives_in`). OSError: it cannot be read."""
    with open(path, encoding="utf-8", errors="replace") as fh:
        return directives_in(fh.read(), path)


def directives_in(text: str, path: str) -> list[Directive]:
    """Every line of an ssh_config's ``text`` that runs or loads something, in order.
    The text is only read (nothing is looked up): ``ProxyCommand none`` runs nothing and
    is not listed; ``Match`` lines are listed when any criterion is ``exec``/``!exec``.
    Found once a process for the same text (`_directives`): the launcher checks a
    cluster file's ssh_config each time it reads it, for each of 1,024 workers."""
    return list(_directives(text, path))


@functools.lru_cache(maxsize=16)
def _directives(text: str, path: str) -> tuple[Directive, ...]:
    found: list[Directive] = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        setting = _SETTING.match(line) if line and not line.startswith("#") else None
        if setting is None:
            continue
        key, value = setting.group(1).lower(), setting.group(2).strip()
        if key == "match" and _EXEC_WORD.search(value):
            found.append(Directive(path, number, *MATCH_EXEC))
        elif key in COMMAND_DIRECTIVES and value.strip('"').lower() != "none":
            found.append(Directive(path, number, *COMMAND_DIRECTIVES[key]))
    return tuple(found)


def named_by_file(cluster: ClusterSpec, worker: WorkerSpec) -> bool:
    """Whether ``worker`` is reached over SSH through an ssh_config that came with a
    cluster file (``ssh.config_file``), not from the operator's own flags (``--hosts``
    with ``-F``: ``named_by`` is set). A local worker's ``ssh`` block is never read."""
    return (worker.ssh.config_file is not None and cluster.named_by is None
            and kind_name(worker) == SSH)


def config_problems(cluster: ClusterSpec) -> list[Problem]:
    """A problem for each directive that runs something in a cluster file's ssh_config
    that the operator did not allow (`with_trust`), naming the file's key, the
    ssh_config's file and line, and the directive. Each file is read once."""
    problems: list[Problem] = []
    seen: dict[str, list[Directive]] = {}
    for w in cluster.workers:
        if not named_by_file(cluster, w) or w.ssh.commands_trusted:
            continue
        path = str(w.ssh.config_file)
        if path not in seen:
            try:
                seen[path] = command_directives(path)
            except OSError:  # unreadable: the lookup says so (`sshconfig`), running nothing
                seen[path] = []
            problems += [Problem(cluster.file, f"workers[{w.index}].ssh.config_file",
                                 w.line or None, f"{d}; {HOW_TO_ALLOW}") for d in seen[path]]
    return problems


def refuse_commands(cluster: ClusterSpec) -> None:
    """`config_problems`, raised as one ConfigError (exit 2): called before a cluster
    file's ssh_config is looked up, so nothing of it runs unallowed."""
    problems = config_problems(cluster)
    if problems:
        raise ConfigError(problems)


def with_trust(cluster: ClusterSpec, *, flag: bool,
               file_untrusted: Optional[str]) -> ClusterSpec:
    """The cluster with each worker's ssh_config allowed to run commands where the
    operator allowed it: every worker with ``--trust-ssh-config`` (``flag``); else each
    worker whose ``ssh.allow_commands: true`` is in a cluster file the operator owns
    (``file_untrusted`` None: owned by this user or root and writable by nobody else, as
    `commands.trusted.untrusted` says of the path; else why not).

    An ``allow_commands`` that is not honoured while its ssh_config does run commands is
    refused here with the reason (exit 2), rather than later as if it were not written.
    """
    if flag:
        trusted = {w.host for w in cluster.workers}
    else:
        asked = {w.host for w in cluster.workers if w.ssh.allow_commands}
        trusted = asked if file_untrusted is None else set()
        if asked and file_untrusted is not None:
            _refuse_claim(cluster, asked, file_untrusted)
    if not trusted:
        return cluster
    return dataclasses.replace(cluster, workers=tuple(
        dataclasses.replace(w, ssh=dataclasses.replace(w.ssh, commands_trusted=True))
        if w.host in trusted else w for w in cluster.workers))


def _refuse_claim(cluster: ClusterSpec, asked: set[str], why: str) -> None:
    """``ssh.allow_commands: true`` in a file the operator does not own, where the
    ssh_config runs commands: refused, saying why the key does not count."""
    runs = {p.key for p in config_problems(cluster)}
    problems = [Problem(cluster.file, f"workers[{w.index}].ssh.allow_commands", w.line or None,
                        f"not honoured: {why}; only a cluster file you own may allow its "
                        "ssh_config to run commands (or give --trust-ssh-config)")
                for w in cluster.workers
                if w.host in asked and f"workers[{w.index}].ssh.config_file" in runs]
    if problems:
        raise ConfigError(problems + config_problems(cluster))


__all__ = ["COMMAND_DIRECTIVES", "Directive", "HOW_TO_ALLOW", "MATCH_EXEC",
           "command_directives", "commands_may_run", "config_problems", "directives_in",
           "inert",
           "named_by_file", "refuse_commands", "with_trust"]
