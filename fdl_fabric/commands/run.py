"""``fdl-fabric run``: torchrun's command line, on this machine or on ``--hosts``.

Replace ``torchrun`` with ``fdl-fabric run`` in a command line and it works the same:
the same common flags, the same worker environment (RANK, LOCAL_RANK, WORLD_SIZE,
MASTER_ADDR/PORT, TORCHELASTIC_*...), ``--max-restarts`` with ``attempt_N`` log
folders, error files with a root-cause summary. What it adds is fdl-fabric's
supervision: one agent per host that leashes every worker (nothing outlives the
launcher, not even a daemon), kill-all with a clear verdict, the live table, and
``--log-dir`` kept byte for byte. No cluster.yml is needed: ``--hosts`` (or
``--hostfile``) runs the same command line on several hosts over SSH, started once,
from this machine (no ``--node-rank`` per host).

torchrun's flags that have no meaning here are refused with what to use instead, never
silently ignored. Every other flag is `commands.vocabulary`'s, built into a launch by
`commands.options`, as ``fdl-fabric launch`` builds its own.
"""

from __future__ import annotations

import argparse
import re
import sys
from typing import NoReturn, Optional

from ..errors import EXIT_USAGE, FdlError, usage
from . import vocabulary
from .heap import left_to_the_os
from .options import launch_options, refuse

#: torchrun flags that do not apply to one host, and what to use instead.
REFUSED = {
    "rdzv-backend": "the rendezvous is fdl-fabric's own coordinator, on this machine "
                    "(--rdzv-endpoint HOST:PORT places it)",
    "rdzv-id": "the run id is generated (TORCHELASTIC_RUN_ID)",
    "rdzv-conf": "the coordinator's timeouts are elastic.* in a cluster file "
                 "(docs/elastic.md)",
    "node-rank": "run it once, on this machine: --hosts starts every host's ranks itself "
                 "and numbers them in the order the hosts are given",
    "redirects": "every rank's output is forwarded with a [host:device:rN] prefix; "
                 "--log-dir keeps each rank's stdout and stderr",
    "tee": "every rank's output is forwarded with a [host:device:rN] prefix; --log-dir "
           "keeps each rank's stdout and stderr",
    "local-ranks-filter": "every rank's output is shown (use --quiet for none; --log-dir "
                          "keeps each rank's output apart)",
    "role": "fdl-fabric has one role, `default` (ROLE_NAME)",
    "monitor-interval": "exits are reported the moment they happen; there is no interval",
    "start-method": "workers are always separate processes (fork and exec)",
    "run-path": "run the script as a process (drop --run-path)",
    "signals-to-handle": "SIGINT and SIGTERM stop every rank, SIGUSR1/2 are forwarded",
    "shutdown-timeout": "use --kill-grace (seconds between TERM and KILL)",
    "local-addr": "each host's address is its name, or its ssh_config HostName; "
                  "--master-addr sets rank 0's",
    "event-log-handler": "use --log-dir: it keeps events.jsonl",
    "logs-specs": "use --log-dir",
    "numa-binding": "not supported; bind inside your program",
    "virtual-local-rank": "not supported: LOCAL_RANK is the rank's index on the host",
    "duplicate-stdout-filters": "use --log-dir and grep its files",
    "duplicate-stderr-filters": "use --log-dir and grep its files",
}


class _Parser(argparse.ArgumentParser):
    """argparse whose usage errors are one line naming the flag, exit 2 (`main` says it as
    it says every other bad value), not its usage block."""

    def error(self, message: str) -> NoReturn:
        raise FdlError(_one_line(message), EXIT_USAGE)


def _one_line(message: str) -> str:
    """argparse's ``argument --a/--a_b: ...`` as ``--a: ...``, as every other flag is named."""
    named = re.fullmatch(r"argument ([^/:\s]+)(?:/\S+)?: (.*)", message, re.DOTALL)
    if named is not None:
        flag, what = named.groups()
        what = {"expected one argument": "expected a value"}.get(what, what)
        what = re.sub(r"^ignored explicit argument (.*)", r"takes no value, got \1", what)
        message = f"{flag}: {what}"
    unknown = re.fullmatch(r"unrecognized arguments: (.+)", message)
    if unknown is not None:
        given = [word.split("=", 1)[0] for word in unknown.group(1).split()]
        message = f"{', '.join(given)}: no such flag{'s' if len(given) > 1 else ''}"
    return f"{' '.join(message.split())} (fdl-fabric run --help lists the flags)"


def parser() -> argparse.ArgumentParser:
    """torchrun's command line: the flags of `vocabulary` that ``run`` has (with torchrun's
    ``--snake_case`` spellings), then the script and its arguments."""
    p = _Parser(prog="fdl-fabric run", allow_abbrev=False, add_help=False)
    p.add_argument("-h", "--help", action="store_true")
    for flag in vocabulary.flags_of("run"):
        names = [f"-{flag.short}"] if flag.short else []
        names += [flag.long] + ([f"--{flag.name}"] if flag.torchrun and "_" in flag.name
                                else [])
        if flag.on_by_default:
            p.add_argument(f"--no-{flag.long[2:]}", dest=flag.name, action="store_false",
                           default=True)
        elif flag.counted:
            p.add_argument(*names, dest=flag.name, action="count", default=0)
        elif flag.metavar is None:
            p.add_argument(*names, dest=flag.name, action="store_true")
        else:
            p.add_argument(*names, dest=flag.name, default=None, metavar=flag.metavar)
    p.add_argument("training_script", nargs="?")
    p.add_argument("training_script_args", nargs=argparse.REMAINDER)
    return p


def _refuse_torchrun_only_flags(argv: list[str]) -> None:
    """Before argparse: a torchrun flag we do not take gets its own explanation, wherever
    it stands among our own flags (their values are skipped, not taken for the script)."""
    valued = {option for action in parser()._actions if action.nargs != 0
              for option in action.option_strings}
    words = iter(argv)
    for word in words:
        if not word.startswith("--"):
            if not word.startswith("-"):
                return  # the script: everything after it is the script's own
            if word in valued:
                next(words, None)
            continue
        if word in valued:  # `--flag value`: the value is not the script
            next(words, None)
            continue
        name = word[2:].split("=", 1)[0].replace("_", "-")
        if name in REFUSED:
            raise usage(f"--{name}", f"not supported by `fdl-fabric run`: "
                              f"{REFUSED[name]}")


def worker_argv(args: argparse.Namespace) -> list[str]:
    """What every rank runs, as torchrun builds it."""
    script_args = list(args.training_script_args)
    if script_args[:1] == ["--"]:
        script_args = script_args[1:]
    if args.no_python:
        if args.module:
            raise usage("--no-python", "cannot be combined with -m")
        return [args.training_script, *script_args]
    if args.module:
        return [sys.executable, "-u", "-m", args.training_script, *script_args]
    return [sys.executable, "-u", args.training_script, *script_args]


def main(argv: Optional[list[str]] = None) -> int:
    """``fdl-fabric run [torchrun flags] script.py args...``: returns the exit code."""
    left_to_the_os()
    args_list = list(sys.argv[1:] if argv is None else argv)
    try:
        _refuse_torchrun_only_flags(args_list)
        args = parser().parse_args(args_list)
        if args.help:
            vocabulary.write_page(vocabulary.help_page("run"))
            return 0
        if args.training_script is None:
            raise usage("training_script", "no script given: fdl-fabric run [flags] "
                        "train.py [args...] (fdl-fabric run --help lists the flags)")
        # Every flag first; the cluster last, as it looks the first host up.
        opts = launch_options(vars(args), command="run", argv=worker_argv(args))
    except FdlError as exc:
        words = args_list[:args_list.index("--")] if "--" in args_list else args_list
        refuse(exc, "fdl-fabric run", as_json="--json" in words or "-j" in words)
        return exc.exit_code
    from .launch import launch  # the launcher's imports, once the flags are good

    return launch(opts)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
