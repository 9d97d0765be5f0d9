"""The words of the commands besides a launch: ``cleanup``, ``prebuild-check``, ``stacks``,
``status``, ``plot-run`` and a refused command line (merged into `words`' one table; kept
apart so each wording module stays one concern)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable

from ..events import Event, Name
from .stacks import stacks_text

Words = Callable[[Event, Mapping[str, Any]], str]


def _cleanup_host(e: Event, d: Mapping[str, Any]) -> str:
    """One host's sweep, in one line."""
    if d.get("error"):
        return f"cleanup: {e.host}: cleanup FAILED: {d['error']}"
    what = [f"{len(s['pids'])} process(es) matching {s['pattern']!r}" if "pattern" in s
            else f"run {s['run']} ranks {s.get('ranks')} (pids {s['pids']})"
            for s in d["stopped"]]
    parts = ["stopped " + ", ".join(what) if what else "nothing to stop"]
    parts += [f"run {item.get('run')} is live ({item.get('launcher')}): left alone (name it "
              "with --run-id, or --force, to stop it)" for item in d["live"]]
    if d["leftovers"]:
        parts.append(f"LEFTOVER: {d['leftovers']}")
    return f"cleanup: {e.host}: " + "; ".join(parts)


def _check_verdict(e: Event, d: Mapping[str, Any]) -> str:
    counts = ", ".join(f"{n} {s}" for s in ("FAIL", "warn", "ok") if (n := d["counts"].get(s)))
    verdict = "FAILED" if d["failed"] else "passed"
    return (f"prebuild-check: {verdict}: {counts or 'no checks'} ({d['hosts']} host(s) in "
            f"{d['elapsed']:.2f} s)")


def _check_report(e: Event, d: Mapping[str, Any]) -> str:
    """A pre-flight report as plain aligned columns, one check a line (greppable)."""
    rows = [(c["host"], c["check"], c["status"], c["reason"]) for c in d["checks"]]
    widths = [max(len(r[i]) for r in [("host", "check", "status"), *rows]) for i in range(3)]
    lines = ["  ".join([*(h.ljust(w) for h, w in zip(("host", "check", "status"), widths)),
                        "detail"]),
             "  ".join(["-" * w for w in widths] + ["-" * 6])]
    lines += ["  ".join([*(r[j].ljust(widths[j]) for j in range(3)), r[3]]).rstrip()
              for r in rows]
    return "\n".join(lines) + "\n"


def _answered(d: Mapping[str, Any]) -> str:
    """``the 3`` when every host asked answered, ``2 of the 3`` when one did not."""
    asked = d.get("of", d["hosts"])
    return f"the {asked}" if asked == d["hosts"] else f"{d['hosts']} of the {asked}"


def status_text(d: Mapping[str, Any]) -> str:
    """``status``: each live run, its launcher, uptime and hosts with their ranks."""
    lines = [f"{len(d['runs'])} live run(s) on {_answered(d)} host(s) of {d['file']}"]
    for run in d["runs"]:
        launcher = run["launcher"]
        who = f"{launcher.get('host', '?')} pid {launcher.get('pid', '?')}" if launcher else "?"
        up = "" if run["uptime"] is None else f", up {_duration(run['uptime'])}"
        lines.append(f"run {run['run']}: launcher {who}{up}")
        for host, ranks in run["hosts"].items():
            states = sorted({r["state"] for r in ranks})
            numbers = [r["rank"] for r in ranks]
            span = f"{numbers[0]}-{numbers[-1]}" if len(numbers) > 1 else str(numbers[0])
            lines.append(f"  {host}: ranks {span} {'/'.join(states)}")
    lines += [f"{host}: not asked: {why}" for host, why in d["problems"].items()]
    return "\n".join(lines)


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"


#: The words of these commands' events.
COMMAND_WORDS: dict[Name, Words] = {
    Name.REFUSED: lambda e, d: (f"{d['command']}: {d['error']}" if d.get("command")
                                else str(d["error"])),
    Name.CLEANUP_HOST: _cleanup_host,
    Name.STEPS_CANCELLED: lambda e, d: (f"cleanup: cancelled agent steps {', '.join(d['steps'])} "
                                        f"of job {d['job']}"),
    Name.STEPS_NOT_CANCELLED: lambda e, d: (f"cleanup: could not list or cancel the agent steps "
                                            f"of job {d['job']}: {d['error']}"),
    Name.CLEANUP_FAILED: lambda e, d: (f"cleanup: FAILED — leftovers or errors on "
                                       f"{', '.join(d['hosts'])}"),
    Name.CLEANUP_VERIFIED: lambda e, d: (f"cleanup: verified — nothing of the selected runs "
                                         f"remains on {d['hosts']} host(s) ({d['stopped']} "
                                         "run(s) stopped)"),
    Name.CHECK_REPORT: _check_report,
    Name.CHECK_VERDICT: _check_verdict,
    Name.STACKS_PROBLEM: lambda e, d: f"stacks: {e.host}: {d['problem']}",
    Name.STACKS_NO_LIVE_RUN: lambda e, d: (f"stacks: no live run of {d['file']} on "
                                           f"{_answered(d)} host(s)"),
    Name.STACKS_RUN_UNKNOWN: lambda e, d: (f"stacks: run {d['run_id']} is not recorded on any "
                                           f"host of {d['file']}"),
    Name.STACKS_VIEW: lambda e, d: stacks_text(dict(d)),
    Name.STATUS_VIEW: lambda e, d: status_text(d),
    Name.PLOT_FAILED: lambda e, d: f"plot-run: cannot draw {d['run_dir']}: {d['error']}",
    Name.PLOT_DRAWN: lambda e, d: str(d["path"]),
}
