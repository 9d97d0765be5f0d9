"""The prebuild-check command: load the cluster file, check every host, render the report.

The invoke task calls `check_cluster` with typed arguments; ``python -m
fdl_fabric.preflight`` parses its own argv once and calls the same function. Either way the
report goes through the one console (`fdl_fabric.presentation.output`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Optional

from ..clusterfile import ClusterSpec
from ..errors import EXIT_USAGE, FdlError
from ..events import EventBus, Name
from ..presentation.output import Console
from ..shell import command_words
from ..transport import resolve_cluster, resolve_settings
from ..transport.configtrust import with_trust
from .run import run_checks

#: ``file_untrusted`` when nobody checked who may change the cluster file (``python -m
#: fdl_fabric.preflight``): its ``ssh.allow_commands`` is then not honoured.
NOT_CHECKED = "who owns the cluster file was not checked (run `inv prebuild-check`)"


def check_cluster(cluster_file: Optional[str], *, cluster: Optional[ClusterSpec] = None,
                  cmd: Optional[str] = None, words: Sequence[str] = (),
                  as_json: bool = False, fast: bool = False, smoke: bool = False,
                  console: Optional[Console] = None, trust_ssh_config: bool = False,
                  file_untrusted: Optional[str] = NOT_CHECKED) -> int:
    """Check every host of ``cluster_file`` (or of ``cluster``, the hosts of ``--hosts``):
    0 nothing FAILs, 1 something does, 2 usage.

    ``words`` (the words after ``--``), else ``cmd``, else the file's ``command:`` is the
    program whose presence is checked on every host, as a launch would resolve it.

    ``trust_ssh_config`` (``--trust-ssh-config``) lets the ssh_config the cluster file
    names run commands; so does its ``ssh.allow_commands: true`` when ``file_untrusted``
    is None: the caller found the file owned by this user or root and writable by nobody
    else (`commands.trusted.untrusted`, a layer above this one), else it says why not.
    Otherwise such an ssh_config is refused, exit 2 (`transport.configtrust`).
    """
    console = console or Console()
    events = EventBus(console)
    try:
        # A `scheduler: slurm` file means the nodes of this allocation, as for a launch:
        # each is checked through its own srun step.
        cluster = resolve_cluster(cluster_file, cluster)
        if cluster.named_by is None:  # a file's ssh_config; the operator's own -F is theirs
            cluster = with_trust(cluster, flag=trust_ssh_config,
                                 file_untrusted=file_untrusted)
        settings = resolve_settings(cluster, events)
    except FdlError as exc:  # a ConfigError is one, exit 2
        events(Name.REFUSED, error=str(exc))
        return exc.exit_code
    try:
        argv = command_words(words, cmd, cluster.command)
    except ValueError as exc:
        events(Name.REFUSED, error=f"{cluster.file}: command: {exc}")
        return EXIT_USAGE
    report = run_checks(cluster, argv=argv, fast=fast, smoke=smoke, settings=settings)
    if as_json:
        console.json(report.to_json())
    else:
        events(Name.CHECK_REPORT, **report.to_json())
        events(Name.CHECK_VERDICT, **report.verdict_data())
    return report.exit_code()


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python3 -m fdl_fabric.preflight --cluster F [--json] [--cmd C] [--fast] [-- prog ...]``."""
    args = list(sys.argv[1:] if argv is None else argv)
    words: list[str] = []
    if "--" in args:
        words = args[args.index("--") + 1:]
        args = args[:args.index("--")]
    parser = argparse.ArgumentParser(
        prog="prebuild-check",
        description="Check every host of a cluster file before launching anything.")
    parser.add_argument("--cluster", default="cluster.yml", help="cluster file")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--cmd", default=None, help="command to check (default: `command:`)")
    parser.add_argument("--fast", action="store_true",
                        help="only what `inv launch` checks: paths, program, port")
    parser.add_argument("--smoke", action="store_true",
                        help="also run one all-reduce on every rank slot")
    parser.add_argument("--trust-ssh-config", action="store_true",
                        help="let the cluster file's ssh_config run commands "
                             "(ProxyCommand, Match exec...)")
    try:
        ns = parser.parse_args(args)
    except SystemExit as exc:  # argparse printed the usage error
        return EXIT_USAGE if exc.code else 0
    return check_cluster(ns.cluster, cmd=ns.cmd, words=words, as_json=ns.json, fast=ns.fast,
                         smoke=ns.smoke, trust_ssh_config=ns.trust_ssh_config)
