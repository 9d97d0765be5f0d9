"""Every usage error of every command exits 2 with one line naming what is wrong, wherever
the bad flag stands (issue 21, item 2; docs/cli.md: "Every flag is checked before anything
happens"): a property test over random command lines.

For each command of ``fdl-fabric`` (run, launch, cleanup, prebuild-check, stacks, status,
plot-run) hypothesis builds command lines that mix valid flags with one or two bad ones:
unknown flags, invoke's own core flags (``--echo``, ``-l``, ``-T 3``), a flag without its
value, a value of the wrong kind (``--nproc-per-node abc``), torchrun flags that ``run``
refuses (``--tee 3``), bad ``--hosts`` ranges and hostfiles, cluster files that are not
there, a bad ``--nnodes``, in random order. Each must exit 2 with nothing on stdout and one
line on stderr, no traceback and no usage block, that names one of the bad flags or values.

Nothing may be started, and no address but loopback contacted: each example runs in-process
through the console script's own entry point (`fdl_fabric.commands.cli.main`), in tmp_path,
under a guard that fails it on any process start or TCP connection and answers every name
lookup that is not loopback with "not found" (the hosts are ``*.invalid`` names, RFC 6761).
A few subprocess runs check the same shape end to end, under ``fdl-fabric`` and ``inv``.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pty
import socket
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional
from unittest import mock

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from fdl_fabric.commands import cli
from fdl_fabric.commands.run import REFUSED
from fdl_fabric.commands.run import parser as run_parser
from fdl_fabric.tasks import ns
from labutil import ROOT

#: Examples per command: each is a few milliseconds in-process, so the whole file stays
#: within seconds on a loaded 2-core machine (FDL_USAGE_EXAMPLES=5000 for a longer hunt).
EXAMPLES = int(os.environ.get("FDL_USAGE_EXAMPLES", "100"))
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture,
                                           HealthCheck.too_slow])

#: The script of a `run` line (never started: every line holds a bad flag).
SCRIPT = ("train.py", "--lr", "0.1")
#: Valid hosts: documentation names that never resolve (the guard makes sure of it).
HOSTS = "node[1-2].invalid"


# -- the files a command line may name (in tmp_path, the working folder) -------------------

CLUSTER = "command: 'true'\nworkers:\n  - host: localhost\n    nproc: 1\n"


def _workdir(root: Path) -> Path:
    """The working folder: a valid cluster file (also as the default cluster.yml), an
    ssh_config, a hostfile, a bad hostfile, an empty file, run folders plot-run refuses."""
    (root / "cluster.yml").write_text(CLUSTER)
    (root / "c.yml").write_text(CLUSTER)
    (root / "ssh_config").write_text("Host *.invalid\n  User nobody\n")
    (root / "hostfile").write_text("# DeepSpeed\nnode1.invalid slots=2\nnode2.invalid\n")
    (root / "badhostfile").write_text("node1.invalid slots=2\nnode2.invalid gpus=4\n")
    (root / "zerohostfile").write_text("node1.invalid slots=0\n")
    (root / "empty").write_text("")
    (root / "norun").mkdir()
    (root / "notjson").mkdir()
    (root / "notjson" / "events.jsonl").write_text("not json\n")
    return root


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else b"/")
            for p in sorted(root.rglob("*"))}


# -- the guard: nothing started, nothing contacted -------------------------------------------

class Started(AssertionError):
    """Something would have been started or contacted before the usage error."""


_LOOPBACK = {"localhost", "127.0.0.1", "::1", "", None}


def _loopback(host: Any) -> bool:
    text = host.decode() if isinstance(host, bytes) else host
    return text in _LOOPBACK or text == socket.gethostname() or \
        (isinstance(text, str) and text.startswith("127."))


@contextlib.contextmanager
def guarded() -> Iterator[list[str]]:
    """Fail on any process start or TCP connection; resolve loopback names only (every other
    name is "not found", so nothing leaves this machine). Yields what was attempted."""
    attempts: list[str] = []

    def refuse(what: str) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            attempts.append(f"{what}{args[1:2] or args[:1]}")
            raise Started(f"{what} before a usage error was reported")
        return call

    real_getaddrinfo, real_connect = socket.getaddrinfo, socket.socket.connect

    def getaddrinfo(host: Any, *args: Any, **kwargs: Any) -> Any:
        if not _loopback(host):
            raise socket.gaierror(socket.EAI_NONAME, "not resolved in this test")
        return real_getaddrinfo(host, *args, **kwargs)

    def by_name(real: Callable[..., Any]) -> Callable[..., Any]:
        def call(host: Any, *args: Any) -> Any:
            if not _loopback(host):
                raise socket.gaierror(socket.EAI_NONAME, "not resolved in this test")
            return real(host, *args)
        return call

    def connect(sock: socket.socket, address: Any) -> Any:
        # A connected UDP socket to loopback sends nothing (it only picks a route).
        if sock.type == socket.SOCK_DGRAM and _loopback(address[0]):
            return real_connect(sock, address)
        attempts.append(f"connect{address!r}")
        raise Started(f"a connection to {address!r} before a usage error was reported")

    with contextlib.ExitStack() as stack:
        for target, name, replacement in (
                (subprocess.Popen, "__init__", refuse("a process")),
                (os, "fork", refuse("fork")),
                (os, "posix_spawn", refuse("posix_spawn")),
                (os, "posix_spawnp", refuse("posix_spawnp")),
                (pty, "fork", refuse("pty.fork")),
                (socket, "getaddrinfo", getaddrinfo),
                (socket, "gethostbyname", by_name(socket.gethostbyname)),
                (socket, "gethostbyname_ex", by_name(socket.gethostbyname_ex)),
                (socket, "gethostbyaddr", by_name(socket.gethostbyaddr)),
                (socket.socket, "connect", connect),
                (socket.socket, "connect_ex", connect)):
            stack.enter_context(mock.patch.object(target, name, replacement))
        yield attempts


@dataclass
class Outcome:
    code: Any
    out: str
    err: str
    attempts: list[str]


def fdl_fabric_main(argv: Sequence[str]) -> Outcome:
    """``fdl-fabric ARGV`` in this process, as the console script runs it."""
    out, err = io.StringIO(), io.StringIO()
    code: Any = 0
    with guarded() as attempts, mock.patch.object(sys, "argv", ["fdl-fabric", *argv]), \
            contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            cli.main(["fdl-fabric", *argv])
        except SystemExit as exc:
            code = exc.code
    return Outcome(code, out.getvalue(), err.getvalue(), attempts)


# -- command lines: items, valid and bad ------------------------------------------------------

@dataclass(frozen=True)
class Item:
    """Words that stand together on a command line (a flag and its value)."""

    words: tuple[str, ...]
    #: What the item sets; two items of one group are not put on one line (``--cluster``
    #: and ``--hosts`` are one group: each names the hosts).
    groups: frozenset[str]
    #: A bad item: the error line names one of these.
    names: tuple[str, ...] = ()
    #: Ends with a flag still waiting for a value (a missing value, invoke's ``-v``): the
    #: next item must start with a known flag, or nothing may follow.
    hangs: bool = False
    #: Starts with a flag the command knows (a bare word or an unknown flag could be taken
    #: for the value of a flag before it).
    known: bool = True

    @property
    def bad(self) -> bool:
        return bool(self.names)


def item(*words: str, group: Any = None, names: Sequence[str] = (), hangs: bool = False,
         known: bool = True) -> Item:
    groups = frozenset([group] if isinstance(group, str) else group or [words[0]])
    # invoke gives a flag waiting for its value the next word whole: `--x=1` and `-vv` too.
    first = words[0] if words else ""
    known = known and "=" not in first and not (first[:1] == "-" and first[1:2] != "-"
                                                and len(first) > 2)
    return Item(tuple(words), groups, tuple(names), hangs, known)


def flag_value(flag: str, value: str, *, group: Any = None, names: Sequence[str] = ()
               ) -> st.SearchStrategy[Item]:
    """``--flag value`` or ``--flag=value`` (the second only for long flags)."""
    names = tuple(names) or (flag, value)
    forms = [item(flag, value, group=group or flag, names=names)]
    if flag.startswith("--") and value:
        forms.append(item(f"{flag}={value}", group=group or flag, names=names))
    return st.sampled_from(forms)


def bad_values(flag: str, values: Sequence[str], *, group: Any = None,
               extra: Optional[st.SearchStrategy[str]] = None) -> st.SearchStrategy[Item]:
    pool: st.SearchStrategy[str] = st.sampled_from(list(values))
    if extra is not None:
        pool = st.one_of(pool, extra)
    return pool.flatmap(lambda v: flag_value(flag, v, group=group))


#: Words that are no number of anything (letters first; never gpu/cpu/auto, nan is bad too).
WORDS = st.from_regex(r"[a-z][a-z0-9]{0,6}", fullmatch=True).filter(
    lambda w: w not in {"gpu", "cpu", "auto", "v", "vv", "vvv"})
SECONDS_BAD = ["abc", "nan", "inf", "-1", "1e999", "5s", "٣", " "]
COUNT_BAD = ["abc", "-2", "1.5", "1001", "²", "x1"]
NPROC_BAD = ["abc", "0", "2000", "-1", "1.5", "１"]
PORT_BAD = ["abc", "0", "70000", "-5", "1e3"]
HOSTS_BAD = ["node[2-1]", "node[1-", "a,a", "a[1-2],a2", "bad host", "x..y", "ab$", "a/b",
             "256.1.1.1", "n[1-5000]", "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"
             "aaaaaaaaaaaaaaaa.invalid"]


def unknown_flags(known: set[str]) -> st.SearchStrategy[Item]:
    """A long flag the command does not have (``--x`` or ``--x=1``), or a short one."""
    long = st.from_regex(r"--[a-z][a-z0-9]{0,8}(-[a-z0-9]{1,5})?", fullmatch=True)
    short = st.sampled_from([f"-{c}" for c in "abgijnostuwxyzABEGIJKLMNOPQSUWXYZ"])
    spelled = st.one_of(long, long.map(lambda f: f + "=1"), short)
    return spelled.filter(lambda f: f.split("=")[0] not in known).map(
        lambda f: item(f, group=f"unknown{f}", names=[f.split("=")[0]], known=False))


# -- invoke's tasks -----------------------------------------------------------------------

def _context(task: str) -> Any:
    return next(c for c in ns.to_contexts() if c.name == task)


def known_flags(task: str, fdl: bool = True) -> set[str]:
    """The task's flags; under ``inv``, invoke's core flags too (``--list``, ``-w``...)."""
    ctx = _context(task)
    core = set() if fdl else {f"-{n}" if len(n) == 1 else f"--{n}"
                              for arg in cli.program().core_args() for n in arg.names}
    return {*ctx.flags, *ctx.flags.aliases, *ctx.inverse_flags, "-h", "--help", *core}


def core_flags(task: str, fdl: bool) -> st.SearchStrategy[Item]:
    """invoke's core flags not of this task: `--echo`, `-l`, `-T 3`... (no `--help`):
    unknown to ``fdl-fabric``, invoke's own under ``inv``."""
    return st.sampled_from(_core_items(task)) if fdl else st.nothing()


def _core_items(task: str) -> list[Item]:
    known = known_flags(task)
    found = []
    for arg in cli.program().core_args():
        if arg.name in cli.CORE_FLAGS:
            continue
        for name in arg.names:
            spelled = f"-{name}" if len(name) == 1 else f"--{name}"
            if spelled in known:
                continue
            words = (spelled, "3") if arg.takes_value and not arg.optional else (spelled,)
            # Not the task's: after a flag waiting for its value, invoke takes it for that
            # value. --list and the like wait for an optional value of their own.
            found.append(item(*words, group=f"core-{arg.name}", names=[spelled], known=False,
                              hangs=arg.optional))
    return found


def _missing(task: str, also: Sequence[str] = ()) -> list[Item]:
    """Each flag of the task that takes a value, without it (all its spellings)."""
    ctx = _context(task)
    found = []
    for long, arg in ctx.flags.items():
        if not arg.takes_value or arg.optional:
            continue
        for spelled in [long, *(a for a, to in ctx.flags.aliases.items() if to == long)]:
            found.append(item(spelled, group=long, names=[long, spelled, *also], hangs=True))
    return found


def stray_word(task: str) -> st.SearchStrategy[Item]:
    tasks = {c.name for c in ns.to_contexts()} | set(cli.COMMANDS)
    return WORDS.filter(lambda w: w not in tasks).map(
        lambda w: item(w, group=f"word{w}", names=[w], known=False))


def cluster_bad(flag: str = "--cluster", *, empty: bool = True) -> st.SearchStrategy[Item]:
    """A cluster file that is not there, a folder, an empty file; ``empty``: ``--cluster ''``
    too (under ``inv``, stacks, cleanup and status let that error out as a traceback:
    `test_known_gaps_outside_the_parsing_code`)."""
    missing = st.from_regex(r"missing-[a-z0-9]{1,8}\.yml", fullmatch=True)
    return st.one_of(
        missing.map(lambda f: item(flag, f, group="source", names=[f])),
        st.sampled_from([item(flag, "norun", group="source", names=["norun"]),
                         item(flag, "empty", group="source", names=["empty"]),
                         *([item(flag, "", group="source", names=["--cluster"])]
                           if empty else [])]))


def host_valid(group: str = "source") -> list[Item]:
    """The host flags every command that reaches hosts takes, the same way (issue 29)."""
    return [item("-H", HOSTS, "-l", "root", "-p", "2222", group=[group, "ssh"]),
            item("--hosts", "root@" + HOSTS + ":2222", group=group),
            item("--hostfile", "hostfile", "-i", "ssh_config", group=[group, "ssh"])]


def host_bad(group: str = "source") -> st.SearchStrategy[Item]:
    """What each of those commands refuses of them, by the same words."""
    return st.one_of(
        bad_values("--hosts", HOSTS_BAD, group=group),
        bad_values("-H", HOSTS_BAD, group=group).map(
            lambda i: Item(i.words, i.groups, ("--hosts",), i.hangs, i.known)),
        st.sampled_from([
            item("-l", "root", group=[group, "ssh"], names=["-l/--user"]),
            item("-H", HOSTS, "-p", "0", group=[group, "ssh"], names=["--port"]),
            item("-H", HOSTS + ":99999", group=group, names=["--hosts"]),
            item("-H", HOSTS, "-i", "missing-key", group=[group, "ssh"],
                 names=["--identity"]),
            item("-F", "ssh_config", group=[group, "ssh"], names=["--ssh-config"])]))


@dataclass
class Spec:
    valid: list[Item]
    bad: st.SearchStrategy[Item]
    #: `run`: the script ends the line (argparse); invoke's tasks: nothing does.
    script: bool = False
    #: plot-run: a positional word that must be on the line (bad ones here).
    positional: Optional[st.SearchStrategy[Item]] = None


def specs(fdl: bool = True) -> dict[str, Spec]:
    """Each command's items, for ``fdl-fabric`` or (``fdl=False``) for ``inv``."""
    L = "launch"
    cmd = item("--cmd", "python3 -u train.py --lr 0.1", group="cmd")
    launch = Spec(
        valid=[
            item("--cluster", "c.yml", group="source"), item("-c", "c.yml", group="source"),
            item("-H", HOSTS, "-F", "ssh_config", "--nproc-per-node", "2", "--cmd",
                 "python3 train.py", group=["source", "ssh", "nproc", "cmd"]),
            item("--hostfile", "hostfile", "--cmd", "python3 train.py",
                 group=["source", "cmd"]),
            cmd, item("--kill-grace", "5", group="kill"), item("-k", "2.5", group="kill"),
            item("--kill-grace=7", group="kill"), item("-q", group="quiet"),
            item("--quiet", group="quiet"), item("-v", group="verbose", hangs=True),
            item("-vv", group="verbose"),
            item("--verbose=2", group="verbose"),
            item("--max-failure", "25%"), item("--max-restarts", "2"),
            item("--log-dir", "logs", group="log"),
            item("-H", HOSTS, "-l", "root", "-p", "2222", "-i", "ssh_config", "--cmd",
                 "python3 train.py", group=["source", "ssh", "cmd"]),
            item("-H", HOSTS, "--controller-port", "29400", "--master-port", "29500",
                 "--cmd", "python3 train.py", group=["source", "cmd", "rdzv"]),
            item("-H", HOSTS, "--rdzv-endpoint", "127.0.0.1:29400", "--cmd",
                 "python3 train.py", group=["source", "cmd", "rdzv"]),
            item("--dry-run", group="dry"), item("-d", group="dry"),
            item("--no-preflight"), item("--agent-timeout", "12"),
            item("--hang-timeout", "0"), item("--json", group="json"),
            item("-j", group="json")],
        bad=st.one_of(
            unknown_flags(known_flags(L, fdl)), core_flags(L, fdl),
            st.sampled_from(_missing(L)), stray_word(L),
            bad_values("--kill-grace", SECONDS_BAD, group="kill"),
            bad_values("-k", ["abc", "-1", "nan"], group="kill", extra=WORDS),
            bad_values("--hang-timeout", SECONDS_BAD),
            bad_values("--agent-timeout", [*SECONDS_BAD, "1", "5.9"]),
            bad_values("--max-restarts", COUNT_BAD),
            bad_values("--nproc-per-node", [*NPROC_BAD, "gpu"], group="nproc"),
            bad_values("--max-failure", ["abc", "200%", "x%", "-1"], extra=WORDS),
            bad_values("--verbose", ["x", "9", "vx"], group="verbose"),
            st.sampled_from([item("-vvvv", group="verbose", names=["--verbose"]),
                             item("--cmd", "   ", group="cmd", names=["--cmd"]),
                             item("--cmd", "", group="cmd", names=["--cmd"]),
                             item("--log-dir", "empty/x", group="log", names=["--log-dir"]),
                             item("--dry-run=1", group="dry", names=["--dry-run"]),
                             item("--slurm", group="source", names=["--slurm"]),
                             item("--ssh-config", "ssh_config", group=["ssh", "source"],
                                  names=["--ssh-config"]),
                             # -l was --log-dir: with a cluster file it says so
                             item("-l", "logs", group=["ssh", "source"],
                                  names=["-l/--user"]),
                             item("-H", HOSTS, "--port", "70000", group=["ssh", "source"],
                                  names=["--port"]),
                             item("-H", HOSTS, "--rdzv-endpoint", "nowhere", group=[
                                 "source", "rdzv"], names=["--rdzv-endpoint"]),
                             item("--controller-port", "29400", group=["source", "rdzv"],
                                  names=["--controller-port"]),
                             item("--hosts", HOSTS, "--ssh-config", "missing_config",
                                  group=["source", "ssh"], names=["--ssh-config"]),
                             item("--hosts", HOSTS, "--hostfile", "hostfile",
                                  group="source", names=["--hosts"]),
                             item("--cluster", "c.yml", "--hosts", HOSTS, group="source",
                                  names=["--hosts"]),
                             item("--cluster", "c.yml", "--nproc-per-node", "2",
                                  group=["source", "nproc"], names=["--nproc-per-node"]),
                             item("--hostfile", "missing-hostfile", group="source",
                                  names=["missing-hostfile"]),
                             item("--hostfile", "badhostfile", group="source",
                                  names=["badhostfile:2"]),
                             item("--hostfile", "zerohostfile", group="source",
                                  names=["zerohostfile:1"])]),
            bad_values("--hosts", HOSTS_BAD, group="source"),
            bad_values("-H", HOSTS_BAD, group="source").map(
                lambda i: Item(i.words, i.groups, ("--hosts",), i.hangs, i.known)),
            cluster_bad(empty=fdl), cluster_bad("-c", empty=fdl)))

    C = "cleanup"
    SLURM = ["source", "scope", "pattern"]  # --slurm refuses --all and --pattern
    cleanup = Spec(
        valid=[item("--cluster", "c.yml", group="source"), item("--run-id", "r0123abcd"),
               item("--all", group="scope"), item("--force"),
               item("--pattern", "fdl-no-such-process-[0-9]{40}", group="pattern"),
               *host_valid()],
        bad=st.one_of(
            unknown_flags(known_flags(C, fdl)), core_flags(C, fdl),
            st.sampled_from(_missing(C)), stray_word(C), cluster_bad(empty=fdl), host_bad(),
            st.sampled_from([item("--slurm", "--all", group=SLURM, names=["--all"]),
                             item("--slurm", "--pattern", "x", group=SLURM,
                                  names=["--pattern"]),
                             item("--slurm", group=SLURM, names=["--slurm"]),
                             item("--all=1", group="scope", names=["--all"])])))

    S = "stacks"
    stacks = Spec(
        valid=[item("--cluster", "c.yml", group="source"), item("--run-id", "r0123abcd"),
               *host_valid()],
        bad=st.one_of(unknown_flags(known_flags(S, fdl)), core_flags(S, fdl),
                      st.sampled_from(_missing(S)), stray_word(S), cluster_bad(empty=fdl),
                      host_bad()))

    T = "status"
    status = Spec(
        valid=[item("--cluster", "c.yml", group="source"),
               item("--hosts", HOSTS, "--ssh-config", "ssh_config", group=["source", "ssh"]),
               item("--hosts", "localhost," + HOSTS, group="source"),
               item("--hostfile", "hostfile", group="source"),
               item("--all"), item("--json"), *host_valid()],
        bad=st.one_of(
            unknown_flags(known_flags(T, fdl)), core_flags(T, fdl),
            st.sampled_from(_missing(T)), stray_word(T), cluster_bad(empty=fdl), host_bad(),
            st.sampled_from([item("--ssh-config", "ssh_config", group=["ssh", "source"],
                                  names=["--ssh-config"]),
                             item("--hosts", HOSTS, "--ssh-config", "missing_config",
                                  group=["source", "ssh"], names=["--ssh-config"]),
                             item("--hosts", HOSTS, "--cluster", "c.yml", group="source",
                                  names=["--hosts"]),
                             item("--hostfile", "missing-hostfile", group="source",
                                  names=["missing-hostfile"]),
                             item("--hostfile", "badhostfile", group="source",
                                  names=["badhostfile:2"])])))

    P = "prebuild-check"
    prebuild = Spec(
        valid=[item("--cluster", "c.yml", group="source"), item("--json"),
               item("--cmd", "python3 train.py", group="cmd"), item("--fast"),
               *host_valid()],
        bad=st.one_of(
            unknown_flags(known_flags(P, fdl)), core_flags(P, fdl),
            st.sampled_from(_missing(P)), stray_word(P), host_bad(),
            cluster_bad(empty=False),  # `--cluster ''` is taken for cluster.yml: a known gap
            st.sampled_from([item("--cmd", "", group="cmd", names=["--cmd", "command"]),
                             item("--json=1", group="--json", names=["--json"])])))

    R = "plot-run"
    plot = Spec(
        valid=[item("--output", "out.svg", group="output"),
               item("-o", "out.png", group="output")],
        bad=st.one_of(
            unknown_flags(known_flags(R, fdl)), core_flags(R, fdl),
            st.sampled_from(_missing(R, also=["run_dir"])),
            st.sampled_from([item("--output", "out.txt", group="output", names=["out.txt"]),
                             item("-o", "out", group="output", names=["out"])])),
        # The run folder: one that is not there, one without events, one whose events are
        # not JSON (none at all: invoke would take the first flag for it; tested apart).
        positional=st.one_of(
            st.from_regex(r"missing-run-[a-z0-9]{1,6}", fullmatch=True).map(
                lambda d: item(d, group="run_dir", names=[d, "run_dir"], known=False)),
            st.sampled_from([item(d, group="run_dir", names=[d, "run_dir"], known=False)
                             for d in ("norun", "notjson")])))

    return {"launch": launch, "cleanup": cleanup, "stacks": stacks, "status": status,
            "prebuild-check": prebuild, "plot-run": plot, **({"run": run_spec()} if fdl else {})}


def run_spec() -> Spec:
    """``fdl-fabric run``: torchrun's command line (argparse), the script last."""
    known = {o for a in run_parser()._actions for o in a.option_strings}
    refused_words = set()
    for name in REFUSED:
        refused_words |= {f"--{name}", f"--{name.replace('-', '_')}"}
    valued = sorted({a.option_strings[0]: a for a in run_parser()._actions
                     if a.option_strings and a.nargs != 0 and a.option_strings[0] != "-h"
                     }.items())
    missing = [item(spelled, group=a.option_strings[0], hangs=True,
                    names=[a.option_strings[0], spelled])
               for _, a in valued for spelled in a.option_strings]
    refused = st.tuples(st.sampled_from(sorted(REFUSED)), st.booleans(), st.integers(0, 2)).map(
        lambda t: item(*_refused_words(*t), group=f"refused{t[0]}", names=[f"--{t[0]}"]))
    return Spec(
        valid=[
            item("--nproc-per-node", "2", group="nproc"), item("--nproc_per_node=2",
                                                               group="nproc"),
            item("--nproc-per-node", "cpu", group="nproc"),
            item("--hosts", HOSTS, "-F", "ssh_config", "--nnodes", "1:2",
                 group=["hosts", "ssh", "nnodes"]),
            item("--hostfile", "hostfile", group="hosts"), *host_valid("hosts"),
            item("--nnodes", "1", group="nnodes"), item("--standalone"),
            item("--dry-run", group="dry"),
            item("--master-port", "29555", group="port"),
            item("--master_port=29556", group="port"), item("--master-addr", "127.0.0.1"),
            item("--max-restarts", "1", group="restarts"),
            item("--max_restarts=0", group="restarts"),
            item("--log-dir", "logs", group="log"), item("-m", group="module"),
            item("--no-python", group="module"), item("--kill-grace", "5", group="kill"),
            item("--hang-timeout", "0", group="hang"), item("--json"), item("--quiet"),
            item("-v", group="verbose"), item("-vv", group="verbose")],
        bad=st.one_of(
            unknown_flags(known | refused_words), refused, st.sampled_from(missing),
            bad_values("--nproc-per-node", NPROC_BAD, group="nproc"),
            bad_values("--nproc_per_node", NPROC_BAD, group="nproc").map(
                lambda i: Item(i.words, i.groups, ("--nproc-per-node",), i.hangs, i.known)),
            bad_values("--master-port", PORT_BAD, group="port"),
            bad_values("--max-restarts", COUNT_BAD, group="restarts"),
            bad_values("--kill-grace", SECONDS_BAD, group="kill"),
            bad_values("--hang-timeout", SECONDS_BAD, group="hang"),
            bad_values("--nnodes", ["0", "abc", "3:2", "1:x", "0:2", "-1"], group="nnodes"),
            host_bad("hosts"),
            st.sampled_from([
                item("--nnodes", "2", group=["hosts", "nnodes"], names=["--nnodes"]),
                item("--hosts", HOSTS, "--nnodes", "3", group=["hosts", "nnodes"],
                     names=["--nnodes"]),
                item("--hosts", HOSTS, "--nnodes", "3:4", group=["hosts", "nnodes"],
                     names=["--nnodes"]),
                item("--hosts", HOSTS, "--master-port", "0", group=["hosts", "port"],
                     names=["--master-port"]),
                item("--hosts", HOSTS, "--hostfile", "hostfile", group="hosts",
                     names=["--hosts"]),
                item("--hosts", HOSTS, "-F", "missing_config", group=["hosts", "ssh"],
                     names=["--ssh-config"]),
                item("-F", "ssh_config", group=["ssh", "hosts"], names=["--ssh-config"]),
                item("--hostfile", "missing-hostfile", group="hosts",
                     names=["missing-hostfile"]),
                item("--hostfile", "badhostfile", group="hosts", names=["badhostfile:2"]),
                item("--log-dir", "empty/x", group="log", names=["--log-dir"]),
                item("-m", "--no-python", group="module", names=["--no-python"]),
                item("--standalone=1", group="--standalone", names=["--standalone"])])),
        script=True)


def _refused_words(name: str, underscores: bool, form: int) -> tuple[str, ...]:
    flag = f"--{name.replace('-', '_') if underscores else name}"
    return ((flag, "3"), (f"{flag}=3",), (flag,))[form]


SPECS = {"fdl-fabric": specs(), "inv": specs(fdl=False)}


@st.composite
def command_lines(draw: st.DrawFn, command: str, under: str = "fdl-fabric"
                  ) -> tuple[list[str], list[Item]]:
    """A command line of ``command``: one or two bad items among valid ones, in any order."""
    spec = SPECS[under][command]
    bad: list[Item] = []
    for candidate in draw(st.lists(spec.bad, min_size=1, max_size=2)):
        if not any(candidate.groups & b.groups for b in bad):
            bad.append(candidate)
    used = frozenset().union(*(b.groups for b in bad))
    items: list[Item] = []
    for candidate in draw(st.permutations(spec.valid)):
        if not candidate.groups & used and draw(st.booleans()):
            items.append(candidate)
            used |= candidate.groups
    if spec.positional is not None:
        bad.append(draw(spec.positional))
    for b in bad:
        items.insert(draw(st.integers(0, len(items))), b)
    items = _ordered(items)
    words = [w for i in items for w in i.words]
    if spec.script and not (items and items[-1].hangs):
        words += SCRIPT
    return words, [i for i in items if i.bad]


def _ordered(items: list[Item]) -> list[Item]:
    """Keep the order, except that an item left waiting for a value is followed only by a
    flag the command knows (anything else would be taken for the value) or by nothing."""
    items = list(items)
    for _ in range(len(items)):
        wrong = [i for i, it in enumerate(items[:-1]) if it.hangs and not items[i + 1].known]
        if not wrong:
            break
        items.append(items.pop(wrong[0]))
    return items


def check(command: str, words: list[str], bad: list[Item], workdir: Path,
          before: dict[str, bytes], under: str = "fdl-fabric") -> None:
    """Exit 2, nothing started or written, nothing on stdout (under --json at most the
    refusal's record), one line on stderr naming one
    of the bad items (under ``inv``, also in invoke's own words: ``kill_grace``, ``'1'``)."""
    argv = [command, *words]
    done = (fdl_fabric_main if under == "fdl-fabric" else inv_main)(argv)
    shown = f"{under} {' '.join(argv)!r}:\n{done.err}"
    assert not done.attempts, f"{shown}\nstarted or contacted: {done.attempts}"
    assert done.code == 2, f"exit {done.code!r}: {shown}"
    if {"--json", "-j"} & set(words):
        # Under --json a refusal is also its record on stdout, the only one (a line invoke's
        # own parser refuses never reached the command, so it has none).
        records = [json.loads(x) for x in done.out.splitlines()]
        assert len(records) <= 1 and all(r["name"] == "refused" for r in records), shown
    else:
        assert done.out == "", f"stdout: {done.out!r}: {shown}"
    lines = done.err.strip().splitlines()
    assert len(lines) == 1, f"{len(lines)} lines: {shown}"
    line = lines[0]
    assert "Traceback" not in line and not line.startswith("usage:"), shown
    names = [n for b in bad for n in b.names]
    if under == "inv":  # invoke's words: `Flag <Argument: kill_grace (k)>`, `'1'`
        names += [n.lstrip("-").replace("-", "_") for n in names if n.startswith("--")]
        names += [repr(part) for b in bad for w in b.words for part in w.split("=")]
    assert any(n in line for n in names), f"none of {names} named: {shown}"
    assert _snapshot(workdir) == before, f"a file was written or changed: {shown}"


def inv_main(argv: Sequence[str]) -> Outcome:
    """``inv ARGV`` in this process: invoke's own Program over this collection (with the
    collection's one change to it, `tasks._usage_errors_exit_2`)."""
    from invoke.program import Program

    out, err = io.StringIO(), io.StringIO()
    code: Any = 0
    with guarded() as attempts, mock.patch.object(sys, "argv", ["inv", *argv]), \
            contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            Program(namespace=ns, name="inv", binary="inv").run(["inv", *argv])
        except SystemExit as exc:
            code = exc.code
    return Outcome(code, out.getvalue(), err.getvalue(), attempts)


def _given_twice(command: str, words: Sequence[str]) -> bool:
    """A flag with a value given twice: invoke then keeps the first value and, when the
    second has none, says nothing (`fdl-fabric` refuses it; `inv` is invoke's own)."""
    ctx = _context(command)
    for long, arg in ctx.flags.items():
        spellings = {long, *(a for a, to in ctx.flags.aliases.items() if to == long)}
        if arg.takes_value and sum(w.split("=")[0] in spellings for w in words) > 1:
            return True
    return False


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(_workdir(tmp_path))
    for key in [k for k in os.environ if k.startswith(("SLURM_", "INVOKE_", "FLODL_"))]:
        monkeypatch.delenv(key)
    # ~/.ssh/config and invoke's ~/.invoke.yaml are not read: a home of its own, empty.
    (tmp_path / "home").mkdir()
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return tmp_path


def _property(command: str, under: str = "fdl-fabric") -> Callable[..., None]:
    @SETTINGS
    @given(line=command_lines(command, under))
    def test(workdir: Path, line: tuple[list[str], list[Item]]) -> None:
        words, bad = line
        assume(under == "fdl-fabric" or not _given_twice(command, words))
        check(command, words, bad, workdir, _snapshot(workdir), under)

    name = command.replace("-", "_")
    test.__name__ = (f"test_every_usage_error_of_{name}_exits_2_in_one_line" if under ==
                     "fdl-fabric" else f"test_inv_{name}_usage_errors_exit_2_in_one_line")
    return test


test_every_usage_error_of_run_exits_2_in_one_line = _property("run")
test_every_usage_error_of_launch_exits_2_in_one_line = _property("launch")
test_every_usage_error_of_cleanup_exits_2_in_one_line = _property("cleanup")
test_every_usage_error_of_prebuild_check_exits_2_in_one_line = _property("prebuild-check")
test_every_usage_error_of_stacks_exits_2_in_one_line = _property("stacks")
test_every_usage_error_of_status_exits_2_in_one_line = _property("status")
test_every_usage_error_of_plot_run_exits_2_in_one_line = _property("plot-run")

# The same command lines under `inv`, invoke's own parser: its core flags are its own there,
# and its words are its own (`tasks._usage_errors_exit_2` only makes the exit code 2).
test_inv_launch_usage_errors_exit_2_in_one_line = _property("launch", "inv")
test_inv_cleanup_usage_errors_exit_2_in_one_line = _property("cleanup", "inv")
test_inv_prebuild_check_usage_errors_exit_2_in_one_line = _property("prebuild-check", "inv")
test_inv_stacks_usage_errors_exit_2_in_one_line = _property("stacks", "inv")
test_inv_status_usage_errors_exit_2_in_one_line = _property("status", "inv")
test_inv_plot_run_usage_errors_exit_2_in_one_line = _property("plot-run", "inv")


# -- end to end: the console script and inv as processes ----------------------------------

def _process(argv: Sequence[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "INVOKE_", "FLODL_"))}
    env["HOME"] = str(cwd / "home")
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=60,
                          cwd=str(cwd), env=env)


@pytest.mark.parametrize(("argv", "line"), [
    (["run", "--nproc-per-node", "2", "--bogus", "x.py"],
     "fdl-fabric run: --bogus: no such flag (fdl-fabric run --help lists the flags)"),
    (["run", "--master-port", "abc", "--tee", "3", "x.py"], "fdl-fabric run: --tee: not "
     "supported by `fdl-fabric run`: every rank's output is forwarded with a [host:device:rN] "
     "prefix; --log-dir keeps each rank's stdout and stderr"),
    (["launch", "--cmd", "true", "--kill-grace"],
     "--kill-grace: expected a value (fdl-fabric launch --help lists the flags)"),
    (["status", "-l"], "--user: expected a value (fdl-fabric status --help lists the flags)"),
    (["stacks", "--cluster", ""], "--cluster: is empty (give a cluster file, or leave the "
     "flag out for cluster.yml)"),
    (["plot-run"], "'plot-run' did not receive required positional arguments: 'run_dir'"),
])
def test_fdl_fabric_says_a_usage_error_in_one_line_and_exits_2(
        argv: list[str], line: str, tmp_path: Path) -> None:
    (_workdir(tmp_path) / "home").mkdir()
    done = _process(["-m", "fdl_fabric", *argv], tmp_path)
    assert (done.returncode, done.stdout, done.stderr) == (2, "", line + "\n")


@pytest.mark.parametrize(("argv", "words"), [
    (["launch", "--no-such-flag"], "--no-such-flag"),
    (["cleanup", "--run-id"], "--run-id: expected a value"),
    (["status", "--hosts", "a,a"], "--hosts: host 'a' is named twice"),
    (["prebuild-check", "--cluster", "missing.yml"], "missing.yml: file not found"),
])
def test_inv_says_a_usage_error_in_one_line_and_exits_2(
        argv: list[str], words: str, tmp_path: Path) -> None:
    (_workdir(tmp_path) / "home").mkdir()
    done = _process(["-m", "invoke", "--search-root", str(ROOT), *argv], tmp_path)
    assert done.returncode == 2 and done.stdout == "", done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and words in done.stderr, done.stderr


# -- gaps this file found outside the parsing code (fixed in tasks.py, flags, output) -------

@pytest.mark.parametrize(("argv", "words"), [
    (["cleanup", "--cluster", "c.yml", "--pattern", "("], "--pattern: not a regular expression"),
    (["prebuild-check", "--cluster", "", "--fast"], "--cluster"),
    (["launch", "--json", "--cluster", "missing.yml"], "missing.yml: file not found"),
])
def test_a_bad_pattern_an_empty_cluster_and_a_json_refusal_are_one_line(
        argv: list[str], words: str, workdir: Path) -> None:
    done = fdl_fabric_main(argv)
    assert not done.attempts and done.code == 2, done.err
    if "--json" in argv:  # the refusal is its one record on stdout too
        (record,) = [json.loads(line) for line in done.out.splitlines()]
        assert record["name"] == "refused" and words in record["data"]["error"]
    else:
        assert done.out == "", done.out
    assert len(done.err.strip().splitlines()) == 1 and words in done.err, done.err


def test_inv_names_each_flag_as_typed_and_never_shows_a_traceback(tmp_path: Path) -> None:
    (_workdir(tmp_path) / "home").mkdir()
    missing = _process(["-m", "invoke", "--search-root", str(ROOT), "launch", "-k"], tmp_path)
    assert missing.stderr.startswith("--kill-grace: expected a value"), missing.stderr
    empty = _process(["-m", "invoke", "--search-root", str(ROOT), "stacks", "--cluster", ""],
                     tmp_path)
    assert (empty.returncode, empty.stderr.count("\n")) == (2, 1), empty.stderr
