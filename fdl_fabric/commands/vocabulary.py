"""Every flag of every command, once: its spellings, its value, its help and its default.

One table, so that a flag means the same thing and is spelled the same way in ``run``,
``launch``, ``status``, ``stacks``, ``cleanup`` and ``prebuild-check`` (``-H/--hosts``
everywhere, ``-h`` help everywhere), and so that the inv tasks, ``fdl-fabric run``'s
parser, the help pages and the shell completion are all read from it. What a value
means is checked in `commands.flags`; how the values become a launch, in
`commands.options`.

Short forms follow the tools users know: ``-H`` hosts (``fab -H``), ``-F`` ssh config,
``-i`` identity, ``-l`` user and ``-p`` port (``ssh``, ``pdsh``, ``clush``), ``-c``
cluster, ``-d`` dry run, ``-j`` JSON, ``-k`` kill grace, ``-q`` quiet, ``-v`` verbose,
``-m`` a module (``fdl-fabric run``, as torchrun and python). ``-n`` (srun's total
tasks) means nothing, and ``-l`` is no longer ``--log-dir``: a cluster-file launch
given ``-l`` is refused with that said (`commands.flags.ssh_defaults`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..clusterfile.model import MASTER_PORT_DEFAULT

#: The commands, in the order help lists them.
COMMANDS = ("run", "launch", "attach", "logs", "stop", "wait", "cleanup", "prebuild-check",
            "stacks", "status", "plot-run", "join", "start")

#: Commands that take hosts (a cluster file, or hosts on the command line).
HOSTED = frozenset({"run", "launch", "cleanup", "prebuild-check", "stacks", "status"})
#: Commands that start a run.
LAUNCHING = frozenset({"run", "launch"})
#: Commands that follow or act on one run of this controller, named by its id (RUN).
OF_A_RUN = frozenset({"attach", "logs", "stop", "wait"})
#: Commands that dial a join window (docs/join.md): the worker's and the operator's.
DIALLING = frozenset({"join", "start"})


@dataclass(frozen=True)
class Flag:
    """One flag: ``name`` is its Python name (``kill_grace`` is ``--kill-grace``)."""

    name: str
    help: str
    commands: frozenset[str]
    #: The value's name in help (``SECONDS``); None: a switch that takes no value.
    metavar: Optional[str] = None
    short: Optional[str] = None
    #: The default as help shows it ("" when there is none to show).
    default: str = ""
    #: A switch that is on unless ``--no-<name>`` is given.
    on_by_default: bool = False
    #: ``fdl-fabric run`` also takes torchrun's ``--snake_case`` spelling.
    torchrun: bool = False
    #: ``-v``, ``-vv``, ``--verbose=N``.
    counted: bool = False

    @property
    def long(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def spellings(self) -> list[str]:
        """Every way to write it on the command line (with ``--no-`` for a switch that is
        on by default)."""
        words = [f"--no-{self.long[2:]}" if self.on_by_default else self.long]
        if self.short:
            words.append(f"-{self.short}")
        if self.torchrun and "-" in self.long[2:]:
            words.append("--" + self.name)
        return words


def _f(name: str, help: str, commands: frozenset[str], **kw: object) -> Flag:
    return Flag(name, help, commands, **kw)  # type: ignore[arg-type]


_RUN = frozenset({"run"})
_LAUNCH = frozenset({"launch"})
_BOTH = LAUNCHING

FLAGS: tuple[Flag, ...] = (
    # Where: the hosts, the same for every command that reaches hosts.
    _f("cluster", "the cluster file (`run`: its hosts, with the script as the command)",
       HOSTED, metavar="FILE", short="c",
       default="cluster.yml, or fdl.cluster in invoke's config; `run`: this machine"),
    _f("hosts", "the hosts, without a cluster file, in rank order: node[1-4],gpu[01-02] "
       "(Slurm and ClusterShell ranges); each entry may say user@ and :port "
       "(root@gpu[1-4]:2222), IPv6 in brackets ([fd00::1]:22)", HOSTED, metavar="LIST",
       short="H"),
    _f("hostfile", "the hosts from a DeepSpeed/MPI hostfile: `host slots=N` per line",
       HOSTED, metavar="FILE"),
    _f("ssh_config", "with --hosts/--hostfile: an ssh_config read instead of "
       "~/.ssh/config, as ssh -F: HostName, User, Port, IdentityFile, ProxyJump per host",
       HOSTED, metavar="FILE", short="F"),
    _f("user", "with --hosts/--hostfile: log in as USER on every host (an entry's user@ "
       "wins), as ssh -l", HOSTED, metavar="USER", short="l"),
    _f("port", "with --hosts/--hostfile: the SSH port of every host (an entry's :port "
       "wins), as ssh -p", HOSTED, metavar="PORT", short="p", default="22, or ssh_config"),
    _f("identity", "with --hosts/--hostfile: the private key for every host, as ssh -i",
       HOSTED, metavar="FILE", short="i"),
    _f("trust_ssh_config", "let the ssh_config a cluster file names (ssh.config_file) "
       "run commands: ProxyCommand, Match exec, LocalCommand, KnownHostsCommand "
       "(refused otherwise, unless ssh.allow_commands: true in a cluster file you own; "
       "docs/security.md)", _BOTH | frozenset({"prebuild-check"})),
    _f("slurm", "the nodes of the Slurm allocation this runs in (salloc, sbatch), one "
       "agent per node started by srun; reads a cluster file only with --cluster",
       frozenset({"launch", "cleanup"})),
    # What runs.
    _f("cmd", "the command every rank runs (default: `command:` of the cluster file); or "
       "give the words after `--`", frozenset({"launch", "prebuild-check"}),
       metavar="COMMAND"),
    _f("nproc_per_node", "ranks on each host (a hostfile's slots=N wins); `run` also "
       "takes gpu, cpu or auto (this machine's count)", _BOTH, metavar="N",
       default="1, or the cluster file's", torchrun=True),
    _f("nnodes", "with --hosts: the fewest hosts an attempt may run on, and how many "
       "start (the rest are spares), as torchrun", _RUN, metavar="N|MIN:MAX", default="1",
       torchrun=True),
    _f("module", "run the script as a module, as python -m", _RUN, short="m"),
    _f("no_python", "run the script directly, not with python", _RUN, torchrun=True),
    _f("standalone", "accepted (torchrun's single-host rendezvous); nothing to do", _RUN),
    # Where ranks meet.
    _f("master_addr", "MASTER_ADDR: the address every rank dials rank 0 at", _BOTH,
       metavar="ADDR", default="the first host's address (its ssh_config HostName)",
       torchrun=True),
    _f("master_port", "MASTER_PORT for torch.distributed", _BOTH, metavar="PORT",
       default=f"a free port when every host is this machine, else {MASTER_PORT_DEFAULT}",
       torchrun=True),
    _f("controller_addr", "the address of this machine that the hosts' ranks dial for "
       "the coordinator", _BOTH, metavar="ADDR",
       default="this machine's address toward the first host"),
    _f("controller_port", "the coordinator's port on this machine", _BOTH, metavar="PORT",
       default="a free port"),
    _f("rdzv_endpoint", "torchrun's spelling of --controller-addr and --controller-port",
       _BOTH, metavar="HOST:PORT", torchrun=True),
    # How it is supervised.
    _f("kill_grace", "seconds between TERM and KILL when ranks are stopped", _BOTH,
       metavar="SECONDS", short="k",
       default="launch: kill_grace (10); run: 30, as torchrun", torchrun=True),
    _f("max_failure", "after the cohort forms, stop the run once this many ranks died "
       "(a count, or a percentage such as 25%)", _BOTH, metavar="N|P%",
       default="elastic.max_failure"),
    _f("max_restarts", "start the whole group again up to N times after a failure, as "
       "torchrun", _BOTH, metavar="N", default="elastic.max_restarts (0)", torchrun=True),
    _f("agent_timeout", "seconds without a word from a host's agent after which the host "
       "is unresponsive and its ranks lost (at least 6)", _BOTH, metavar="SECONDS",
       default="agent_timeout (10)"),
    _f("hang_timeout", "seconds without output or progress from any rank after which the "
       "run is hung: every rank's stack is shown, exit 1; 0 turns it off", _BOTH,
       metavar="SECONDS", default="hang_timeout (off)", torchrun=True),
    _f("fanout", "SSH hosts the launcher reaches itself; beyond it, about sqrt(hosts) of "
       "them are gateways that start the rest with ssh", _BOTH, metavar="N",
       default="fanout (64)"),
    _f("preflight", "check paths, program, ports and MASTER_ADDR on every host before any "
       "rank starts; --no-preflight skips it", _BOTH, on_by_default=True),
    _f("smoke", "before any rank starts, also check every host reaches every other on the "
       "job's ports, and run one all-reduce on every rank slot (the collective smoke test, "
       "docs/prebuild-check.md)", _BOTH | frozenset({"prebuild-check"})),
    _f("sync", "send the code first: the cluster file's folder (run: this folder), or "
       "sync.src, made identical under each remote worker's path; only what changed "
       "travels (docs/code-and-environment.md)", _BOTH, default="sync: in the cluster file"),
    _f("no_sync", "run what the hosts have in their path, even when the cluster file "
       "says sync:", _BOTH),
    _f("python", "the interpreter of ranks whose command starts with python or python3, "
       "on every host (a path relative to the ranks' folder, e.g. .venv/bin/python, or an "
       "absolute one)", _BOTH, metavar="PYTHON",
       default="python: of the cluster file (else the command's own)"),
    _f("detach", "once every rank runs, leave the run to a supervisor with no terminal and "
       "exit 0: closing this terminal changes nothing (attach, logs, stop, wait follow it)",
       _BOTH),
    _f("on", "run it on HOST over SSH, where the same fdl-fabric is installed: launch "
       "--detach starts the run's supervisor there (a head node that stays up: closing "
       "this laptop changes nothing); the others follow that run from here",
       frozenset({"launch"}) | OF_A_RUN | frozenset({"status"}), metavar="HOST"),
    _f("on_exit", "a shell command run once when the run ends, with FDL_FABRIC_RUN_ID, "
       "FDL_FABRIC_VERDICT, FDL_FABRIC_EXIT_CODE and FDL_FABRIC_RUN_DIR set; bounded (60 s), "
       "it never changes the verdict", _BOTH, metavar="COMMAND",
       default="on_exit of the cluster file"),
    # What it shows and keeps.
    _f("log_dir", "keep <dir>/<run_id>/attempt_<k>/r<rank>/{stdout,stderr}.log, "
       "events.jsonl and cluster.json", _BOTH, metavar="DIR",
       default="fdl.log_dir in invoke's config", torchrun=True),
    _f("dry_run", "print each host's agent spec and how it is reached; connect nowhere",
       _BOTH, short="d"),
    _f("quiet", "no rank output: the launcher's lines and the verdict only", _BOTH,
       short="q"),
    _f("verbose", "more detail: -v, -vv, or --verbose=N (1-3); also sets FLODL_VERBOSITY "
       "for the ranks", _BOTH, short="v", counted=True),
    _f("json", "JSON lines on stdout (docs/events.md): every event of a launch, the "
       "verdict last; a report for the others", frozenset({"run", "launch", "status",
                                                           "prebuild-check"}), short="j"),
    # One command's own.
    _f("run_id", "the run: its id or the id's unique start (also given as the word RUN); "
       "cleanup stops only its ranks, join joins only its window, the others look at it "
       "or act on it (default: the newest run)",
       frozenset({"cleanup", "stacks", "join", "start"}) | OF_A_RUN, metavar="RUN_ID"),
    _f("tail", "the last N lines of output first (attach: 20)", frozenset({"attach", "logs"}),
       metavar="N", default="logs: all"),
    _f("follow", "follow the output as it comes, across restarts, to the verdict",
       frozenset({"logs"}), short="f"),
    _f("rank", "only this rank's lines", frozenset({"logs"}), metavar="N"),
    _f("host", "logs: only the lines of this host's ranks; join: the name this worker "
       "joins as", frozenset({"logs", "join"}), metavar="HOST",
       default="join: this machine's name"),
    _f("stop", "Ctrl-C stops the run (TERM, then KILL after the kill grace) instead of "
       "leaving it running", frozenset({"attach"})),
    _f("kill", "stop at once: KILL every rank's process group, no grace",
       frozenset({"stop"})),
    _f("timeout", "give up after SECONDS: exit 124 with the run still going",
       frozenset({"wait"}), metavar="SECONDS", default="none: until the run ends"),
    _f("all", "every recorded run of this user on those hosts, not only this cluster's "
       "(status: this controller's ended runs too)", frozenset({"cleanup", "status"})),
    _f("pattern", "ALSO stop processes whose command line matches this regex, like "
       "`pkill -f` (TERM, 1 s, KILL); may hit processes fdl-fabric did not start",
       frozenset({"cleanup"}), metavar="REGEX"),
    _f("force", "also stop runs whose launcher is alive (otherwise left alone, unless "
       "named with --run-id)", frozenset({"cleanup"})),
    _f("fast", "only what a launch checks before spawning: ssh, paths, program, port",
       frozenset({"prebuild-check"})),
    # Workers that dial in (docs/join.md).
    _f("controller", "the join window's HOST:PORT (join, start: also given as the first "
       "word; status: show that window)", DIALLING | frozenset({"status"}),
       metavar="HOST:PORT"),
    _f("token_file", "a file of yours, mode 0600, holding the window's token (or set "
       "FDL_FABRIC_TOKEN; never a token on the command line)",
       DIALLING | frozenset({"status"}), metavar="FILE",
       default="start, status: the run's record"),
    _f("nproc", "the ranks this worker offers (CPU ranks)", frozenset({"join"}),
       metavar="N"),
    _f("devices", "the GPUs this worker offers: 0,1 or all (nvidia-smi's)",
       frozenset({"join"}), metavar="LIST"),
    _f("path", "the folder the ranks run in on this worker", frozenset({"join"}),
       metavar="DIR", default="the current folder"),
    _f("persist", "dial again: at once after its agent ran (for the next attempt or run), "
       "after 5 s doubling to 60 s after another transient end; stops on a permanent "
       "refusal (exit 2)",
       frozenset({"join"})),
    _f("output", "the picture to write, .svg or .png (default: RUN_DIR/timeline.svg and "
       "timeline.png)", frozenset({"plot-run"}), metavar="FILE", short="o"),
)

BY_NAME = {f.name: f for f in FLAGS}


def flags_of(command: str) -> list[Flag]:
    """The flags of ``command``, in the table's order."""
    return [f for f in FLAGS if command in f.commands]


def short_flags(command: str) -> dict[str, str]:
    """``{python name: letter}`` for an inv task (`tasks._ChosenShortFlags`)."""
    return {f.name: f.short for f in flags_of(command) if f.short}


#: The flag a command's bare word stands for (invoke has no optional positional).
_WORD_FLAG = {**{c: "--run-id" for c in OF_A_RUN}, "start": "--run-id",
              "join": "--controller"}


def named_run(words: list[str]) -> list[str]:
    """``attach``, ``logs``, ``stop``, ``wait`` and ``start`` take their run as a word
    (``fdl-fabric logs RUN``, as ``docker logs`` and ``sky logs``), ``join`` its window's
    address (``fdl-fabric join HOST:PORT``); invoke has no optional positional, so the
    word is handed on as its flag. Other commands' words are left alone."""
    command = words[0].rpartition(".")[2] if words else ""
    if command not in _WORD_FLAG:
        return words
    flag = _WORD_FLAG[command]
    valued = {w for f in flags_of(words[0].rpartition(".")[2]) if f.metavar
              for w in f.spellings}
    out, rest = [words[0]], iter(words[1:])
    for word in rest:
        if word == "--":
            out += [word, *rest]
        elif word in valued:
            out += [word, *([v] if (v := next(rest, None)) is not None else [])]
        elif word.startswith("-"):
            out.append(word)
        else:
            out += [flag, word]
    return out


def task_help(command: str) -> dict[str, str]:
    """invoke's ``help=`` of a task: each flag's words with its default."""
    return {f.name.replace("_", "-"): f.help + (f" (default: {f.default})" if f.default else "")
            for f in flags_of(command)}


#: What each command does and how it is called, for its help page.
USAGE = {
    "run": ("fdl-fabric run [options] SCRIPT [ARGS...]",
            "torchrun's command line, on this machine or on --hosts, supervised to a "
            "verdict. Other torchrun flags are refused with what to use instead."),
    "launch": ("fdl-fabric launch [options] [-- COMMAND WORDS...]",
               "Launch the job of a cluster file (or --hosts) and supervise it to a "
               "verdict."),
    "cleanup": ("fdl-fabric cleanup [options]",
                "Stop leftover ranks of runs whose launcher is gone on every host, then "
                "verify none remains. Only processes fdl-fabric's agents recorded are "
                "stopped."),
    "prebuild-check": ("fdl-fabric prebuild-check [options] [-- COMMAND WORDS...]",
                       "Check every host before launching: ssh, paths, program, GPUs, "
                       "port; one row per host and check."),
    "stacks": ("fdl-fabric stacks [options]",
               "Show where every rank of a live run is (Python stacks, grouped); the run "
               "goes on untouched."),
    "status": ("fdl-fabric status [options]",
               "List this controller's runs (starting, running, stopping; ended ones with "
               "--all), then the live runs on the hosts of the cluster file or --hosts: "
               "run id, launcher, uptime, ranks."),
    "attach": ("fdl-fabric attach [RUN] [options]",
               "Show a run's output so far, then follow it live. Ctrl-C leaves the run "
               "running (--stop: stops it). A run that has ended: its end and its "
               "verdict, and its exit code."),
    "logs": ("fdl-fabric logs [RUN] [options]",
             "Print a run's output as its console showed it, every rank behind its "
             "prefix; -f follows it across restarts to the verdict."),
    "stop": ("fdl-fabric stop [RUN] [options]",
             "Stop a run as a TERM to its launcher would: TERM to every rank, KILL after "
             "the kill grace; the verdict names who stopped it (exit 143)."),
    "wait": ("fdl-fabric wait [RUN] [options]",
             "Wait until a run ends and exit with its exit code (0, 1, 128+N); 124 when "
             "--timeout passes first."),
    "join": ("fdl-fabric join HOST:PORT [options]",
             "Join a launch's join window from this worker (behind NAT, a pod, a VM that "
             "boots and joins): the agent of the fdl-fabric installed here runs its ranks. "
             "Exit 0 done, 1 transient (--persist dials again), 2 permanent."),
    "start": ("fdl-fabric start [RUN] [options]",
              "Close a join window with start: manual or hybrid now that its quorum is in; "
              "refused with why (auto, quorum not met, closed)."),
    "plot-run": ("fdl-fabric plot-run RUN_DIR [options]",
                 "Draw a run's timeline from RUN_DIR/events.jsonl (<log-dir>/<run_id>)."),
}

#: The end of every help page.
EXIT_CODES = ("Exit codes: 0 ok, 1 the run or a host failed, 2 bad input (nothing "
              "started), 128+N interrupted by signal N.")


def help_page(command: str, binary: str = "fdl-fabric", width: int = 88) -> str:
    """One help format for every command, under ``inv`` as under ``fdl-fabric``: the
    usage, what it does, then each flag with its value's name and its default."""
    import textwrap

    usage, about = USAGE[command]
    if binary != "fdl-fabric":
        usage = usage.replace("fdl-fabric", binary, 1)
    rows = [(", ".join(sorted(f.spellings, key=len)) + (f" {f.metavar}" if f.metavar else ""),
             f.help + (f" (default: {f.default})" if f.default else ""))
            for f in flags_of(command)]
    rows.append(("-h, --help", "show this help"))
    left = min(max(len(r[0]) for r in rows) + 4, 34)
    out = [f"usage: {usage}", "", *textwrap.wrap(about, width), "", "options:"]
    for flag, words in rows:
        wrapped = textwrap.wrap(words, width - left, break_long_words=False,
                                break_on_hyphens=False)
        if len(flag) + 2 >= left:
            out.append(f"  {flag}")
            out += [" " * left + w for w in wrapped]
        else:
            out.append(f"  {flag.ljust(left - 2)}{wrapped[0]}")
            out += [" " * left + w for w in wrapped[1:]]
    out += ["", *textwrap.wrap(EXIT_CODES, width)]
    return "\n".join(out) + "\n"


def write_page(text: str) -> None:
    """Print a help page; a reader that stops early (``| head``) is no error, and leaves
    no BrokenPipeError traceback at exit."""
    import os
    import sys

    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # Python's flush at exit then goes nowhere
        os.close(devnull)


def markdown_table() -> str:
    """docs/cli.md's table of every flag of every command (a test keeps the page equal
    to it, so the page and the commands never disagree)."""
    shown = [c for c in COMMANDS]
    head = "| flag | " + " | ".join(f"`{c}`" for c in shown) + " | default | meaning |"
    rows = [head, "|" + "---|" * (len(shown) + 3)]
    for f in FLAGS:
        spelled = ", ".join(f"`{w}{' ' + f.metavar if f.metavar else ''}`"
                            for w in sorted(f.spellings, key=len))
        marks = " | ".join("✓" if c in f.commands else "" for c in shown)
        rows.append(f"| {spelled} | {marks} | {f.default} | {f.help.replace('|', '&#124;')} |")
    return "\n".join(rows) + "\n"
