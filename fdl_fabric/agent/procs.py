"""Which processes belong to a run, the run registry, and stopping them. Only ours.

A process belongs to a run on this host when either

* it is in the process group of one of the run's ranks while that rank's leader is
  still the process the agent started (same pid *and* same start time, so a recycled
  pid is never mistaken for it), or
* it carries the run's id in its environment (``FLODL_INTERNAL_RUN_ID``), and no other
  host name (``FLODL_HOST_NAME``): every rank gets both, and children inherit them,
  including daemons that left the rank's group with ``setsid`` or a double fork. The
  host name matters only where several logical hosts share one machine (the test lab);
  a process of the run that dropped it still counts.

Nothing is ever selected by command line (DeepSpeed's ``pkill -f`` cleanup killed other
users' jobs, DeepSpeed#6807), except behind an explicit ``--pattern``.

The registry is one JSON file per run and host, ``<registry>/<run>@<host>.json`` (folder
0700, file 0600; the folder is ``/tmp/fdl-fabric-<uid>`` unless `registry` says why not),
written by the agent alone, atomically. JSON rather than
``key=value`` text: no field value, such as a host name, can forge another field.
``inv cleanup`` and the agent's pre-spawn sweep read it to find runs that outlived their
launcher.

A run is *live* while its agent is: the record names the agent (pid and start time),
and the agent touches the record every `RECORD_TOUCH` seconds while its loop runs. A
sweep never stops a live run unless it is named (``--run-id``) or forced; then it leaves
a note (`write_stop_note`) so the run's verdict can say who stopped it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import signal
import stat
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

from fdl_fabric.agent import registry
from fdl_fabric.agent.pids import (
    KILL_WAIT,
    STOP_POLL,
    adopted,
    alive,
    carriers,
    cmdline,
    descendants,
    describe,
    group_members,
    own_pids,
    proc_stat,
    signal_pids,
    spared,
    start_time,
    stat_fields,
    stop,
)
from fdl_fabric.agent.registry import RegistryError

#: Seconds between TERM and KILL when a sweep stops leftovers (the seed's `sleep 1`).
SWEEP_GRACE = 1.0
#: 2: the record names its agent (pid, start time) and launcher, and is kept touched.
RECORD_VERSION = 2
#: Seconds between an agent's touches of its record while its loop runs.
RECORD_TOUCH = 2.0
#: A record untouched for this long belongs to an agent that stopped working (frozen,
#: wedged): its run is no longer live, whatever the agent's pid says.
LIVE_WINDOW = 5 * RECORD_TOUCH


def registry_dir() -> str:
    """The folder this host's records are written to (`registry.writable_dir`)."""
    return registry.writable_dir()


# -- the registry ---------------------------------------------------------------------------


def _checked_dir(folder: str, create: bool) -> bool:
    """True when ``folder`` is usable; creates it 0700 if asked. Refuses foreign folders,
    naming their owner and the remedy."""
    if create:
        try:
            registry.make_private(folder)
        except RegistryError as exc:
            raise RegistryError(registry.refusal([str(exc)])) from None
        return True
    why = registry.foreign(folder)
    if why is not None:
        raise RegistryError(registry.refusal([f"{folder} {why}"]))
    return os.path.isdir(folder)


#: Bytes of a rank's error file that are read and reported; the rest is cut.
ERROR_FILE_MAX = 64 * 1024


def error_file(run_id: str, host: str, attempt: int, rank: int,
               folder: Optional[str] = None) -> str:
    """Where a rank writes its error file (torchrun's TORCHELASTIC_ERROR_FILE), made ready.

    Under the run registry, so it is private to the user (0700 folders); a stale file
    from an earlier launch with the same path is removed.
    """
    base = folder or registry_dir()
    _checked_dir(base, create=True)
    leaf = os.path.join(_run_folder(run_id, host, base), f"attempt_{attempt}", f"r{rank}")
    registry.make_private(leaf)  # every level 0700, whatever the umask
    path = os.path.join(leaf, "error.json")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    return path


def read_error_file(path: str) -> str:
    """The text a failed rank left in its error file ("" when it wrote none)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd, "rb") as fh:
            os.fchmod(fd, 0o600)  # the rank wrote it with its own umask (often 0644)
            return fh.read(ERROR_FILE_MAX).decode("utf-8", "replace")
    except OSError:
        return ""


def remove_error_files(run_id: str, host: str, folder: Optional[str] = None) -> None:
    import shutil

    with contextlib.suppress(OSError, ValueError):
        shutil.rmtree(_run_folder(run_id, host, folder))


def _run_name(run_id: str, host: str) -> str:
    """``<run>@<host>``: one host's part of a run. Per host, because several nodes of one
    run can share a machine (and its /tmp) in a test lab."""
    if not re.fullmatch(r"[A-Za-z0-9._-]{1,128}", run_id):
        raise ValueError(f"not a run id: {run_id!r}")
    slug = re.sub(r"[^A-Za-z0-9._-]", "_", host)
    if slug != host or len(slug) > 64:  # keep names short and distinct
        slug = slug[:40] + "-" + hashlib.sha256(host.encode("utf-8")).hexdigest()[:12]
    return f"{run_id}@{slug}"


def _run_folder(run_id: str, host: str, folder: Optional[str] = None) -> str:
    return os.path.join(folder or registry_dir(), _run_name(run_id, host))


def record_path(run_id: str, host: str, folder: Optional[str] = None) -> str:
    return _run_folder(run_id, host, folder) + ".json"


def write_record(record: Dict[str, Any], folder: Optional[str] = None) -> str:
    """Write (or replace) a run's record atomically, 0600. Returns its path. Without
    ``folder``, in the registry, falling back to its next candidate when the disk of one
    is full or read-only (`registry.write_failed`), so a live run is always seen."""
    if folder is not None:
        return _write_record_in(record, folder)
    for _ in registry.candidates():
        place = registry_dir()
        try:
            return _write_record_in(record, place)
        except RegistryError:
            raise
        except OSError as exc:
            registry.write_failed(place, exc)
    return _write_record_in(record, registry_dir())  # raises: no candidate is left


def _write_record_in(record: Dict[str, Any], folder: str) -> str:
    _checked_dir(folder, create=True)
    path = record_path(str(record["run"]), str(record["host"]), folder)
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        try:
            os.write(fd, json.dumps(record, sort_keys=True).encode("utf-8"))
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)  # a full disk leaves no partial file behind
        raise
    return path


def remove_record(run_id: str, host: str, folder: Optional[str] = None,
                  agent: Optional[int] = None) -> bool:
    """Remove a run's record on this host; with ``agent``, only while it is that agent's:
    an attempt cut off by a partition ends after the next attempt's agent on the same
    host wrote its own record under the same name. Whether it went."""
    try:
        path = record_path(run_id, host, folder)
        if agent is not None:
            with open(path, "rb") as fh:
                if json.loads(fh.read(1 << 20).decode("utf-8")).get("agent") != agent:
                    return False
        os.unlink(path)
        return True
    except (OSError, ValueError, AttributeError):
        return False


def read_records(folder: Optional[str] = None) -> tuple:  # type: ignore[type-arg]
    """(records, problems): every readable run record, and why others were skipped. In
    ``folder``, or else in every place this user's registry may be (`registry`)."""
    records: List[Dict[str, Any]] = []
    problems: List[str] = []
    folders = [folder] if folder else registry.readable_dirs()
    for place in folders:
        if _checked_dir(place, create=False):
            _read_folder(place, records, problems)
    return records, problems


def _read_folder(folder: str, records: List[Dict[str, Any]], problems: List[str]) -> None:
    for name in sorted(os.listdir(folder)):
        if not name.endswith(".json"):
            continue
        path = os.path.join(folder, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
            with os.fdopen(fd, "rb") as fh:
                data = json.loads(fh.read(1 << 20).decode("utf-8"))
            record = _valid_record(data)
        except (OSError, ValueError) as exc:
            problems.append(f"{path}: unreadable record ({exc})")
            continue
        record["path"] = path
        records.append(record)


def _valid_record(data: Any) -> Dict[str, Any]:
    """Check a record's shape: every field the sweep relies on, with its type."""
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    for key in ("run", "cluster", "host"):
        if not isinstance(data.get(key), str):
            raise ValueError(f"{key!r} is not a string")
    ranks = data.get("ranks")
    if not isinstance(ranks, list):
        raise ValueError("'ranks' is not a list")
    for r in ranks:
        if not isinstance(r, dict) or not all(
                isinstance(r.get(k), int) and not isinstance(r.get(k), bool)
                for k in ("rank", "pid", "start")):
            raise ValueError("a rank entry lacks integer rank, pid or start")
    _run_name(data["run"], data["host"])  # a run id that is a safe file name
    return dict(data)


def record_members(record: Dict[str, Any]) -> List[int]:
    """Every live process of a recorded run on this host (see the module docstring)."""
    found: Set[int] = set()
    for r in record["ranks"]:
        found.update(group_members(int(r["pid"]), int(r["start"])))
    attempt = record.get("attempt")
    found.update(carriers(record["run"], record["host"],
                          attempt if isinstance(attempt, int) else None))
    return sorted(found)


def touch_record(run_id: str, host: str, folder: Optional[str] = None) -> None:
    """The agent's sign of life on its record (see `record_live`)."""
    with contextlib.suppress(OSError, ValueError):
        os.utime(record_path(run_id, host, folder))


def record_agent(record: Dict[str, Any]) -> Optional[int]:
    """The pid of the record's agent while that very process (same start time) lives."""
    agent, started = record.get("agent"), record.get("agent_start")
    if not isinstance(agent, int) or not isinstance(started, int) or isinstance(agent, bool):
        return None
    st = proc_stat(agent)
    if st is None or st[1] != started or st[2] in ("Z", "X"):
        return None
    return agent


def record_live(record: Dict[str, Any], now: Optional[float] = None) -> bool:
    """True while the record's agent runs its loop: the run's launcher still holds it.

    A record of the first version (no agent), a dead or recycled agent pid, a stopped
    agent (SIGSTOP) or a record untouched for `LIVE_WINDOW` seconds is not live.
    """
    agent = record_agent(record)
    if agent is None:
        return False
    st = proc_stat(agent)
    if st is None or st[2] in ("T", "t"):
        return False
    try:
        touched = os.stat(str(record.get("path") or record_path(record["run"],
                                                                  record["host"]))).st_mtime
    except (OSError, ValueError):
        return False
    return (time.time() if now is None else now) - touched <= LIVE_WINDOW


def launcher_of(record: Dict[str, Any]) -> str:
    """``launcher pid P on H`` for messages, from what the agent recorded."""
    launcher = record.get("launcher")
    if isinstance(launcher, dict) and launcher.get("pid"):
        return f"launcher pid {launcher.get('pid')} on {launcher.get('host', '?')}"
    return f"agent pid {record.get('agent', '?')}"


def _note_path(run_id: str, host: str, folder: Optional[str] = None) -> str:
    return _run_folder(run_id, host, folder) + ".stop"


def write_stop_note(run_id: str, host: str, note: Dict[str, Any],
                    folder: Optional[str] = None) -> None:
    """Who is about to stop a live run: its agent reads this when the TERM arrives."""
    with contextlib.suppress(OSError, ValueError):
        path = _note_path(run_id, host, folder)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        try:
            os.write(fd, json.dumps(note, sort_keys=True).encode("utf-8"))
        finally:
            os.close(fd)


def take_stop_note(run_id: str, host: str, folder: Optional[str] = None) -> Optional[Dict[str,
                                                                                         Any]]:
    """The note a cleanup left before stopping this run (removed once read), if any."""
    try:
        path = _note_path(run_id, host, folder)
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd, "rb") as fh:
            data = json.loads(fh.read(1 << 16).decode("utf-8"))
        os.unlink(path)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def summary(record: Dict[str, Any]) -> Dict[str, Any]:
    """What ``status`` and ``stacks`` need of a record: who, where, since when, live or not."""
    return {"run": record["run"], "cluster": record["cluster"], "host": record["host"],
            "live": record_live(record), "launcher": record.get("launcher"),
            "started": record.get("started"), "agent": record.get("agent"),
            "ranks": [{"rank": r["rank"], "pid": r["pid"],
                       "alive": bool(group_members(int(r["pid"]), int(r["start"])))}
                      for r in record["ranks"]]}


def list_runs(cluster: Optional[str] = None, folder: Optional[str] = None) -> Dict[str, Any]:
    """Every recorded run on this host (of one cluster, if given), newest first."""
    try:
        records, problems = read_records(folder)
    except RegistryError as exc:
        return {"runs": [], "errors": [str(exc)]}
    runs = [summary(r) for r in records if cluster is None or r["cluster"] == cluster]
    runs.sort(key=lambda r: -(r["started"] or 0) if isinstance(r["started"], (int, float))
              else 0)
    return {"runs": runs, "errors": problems}


def sweep_asked(request: Dict[str, Any], wait: Callable[[float], None]) -> Dict[str, Any]:
    """`sweep` as a SWEEP request from the launcher asks it (a cleanup's, or the
    launcher's own for an earlier attempt cut off by a partition)."""
    by, spare, keep = request.get("by"), request.get("spare"), request.get("keep")
    keep_attempt = request.get("keep_attempt")
    return sweep(runs=[str(r) for r in request.get("runs") or []],
                 cluster=request.get("cluster"), all_runs=bool(request.get("all")),
                 pattern=request.get("pattern"), scope=request.get("scope"),
                 force=bool(request.get("force")),
                 spare=spare if isinstance(spare, dict) else None,
                 by=by if isinstance(by, dict) else None,
                 keep=str(keep) if keep is not None else None,
                 keep_attempt=keep_attempt if isinstance(keep_attempt, int) else None,
                 wait=wait)


def sweep(*, runs: Sequence[str] = (), cluster: Optional[str] = None, all_runs: bool = False,
          pattern: Optional[str] = None, grace: float = SWEEP_GRACE,
          folder: Optional[str] = None, keep: Optional[str] = None,
          scope: Optional[str] = None, force: bool = False,
          by: Optional[Dict[str, Any]] = None, spare: Optional[Dict[str, Any]] = None,
          keep_attempt: Optional[int] = None,
          wait: Callable[[float], None] = time.sleep) -> Dict[str, Any]:
    """Stop the recorded runs selected by id, cluster key or ``all_runs``; verify; report.

    A record whose processes are all gone is removed. ``keep`` is a run never selected:
    the run the sweeping agent belongs to, whose other hosts may share this machine's
    registry and be starting right now; with ``keep_attempt``, only that attempt and
    later ones are kept, and an earlier attempt of the run (cut off by a partition, its
    ranks still running) is stopped as if named. A live run (`record_live`) is left alone and
    reported under ``live``, unless it is named in ``runs`` or ``force`` is set; then its
    agent first gets a note saying who stops it (``by``) and a TERM. With ``pattern``,
    processes whose command line matches the regex are stopped too, like ``pkill -f``:
    an explicit opt-in, since it can hit processes fdl-fabric did not start. ``scope`` is
    a cluster key every selected run must have, whatever else selects it: a Slurm job's
    cleanup never reaches a run of another job on the same node. ``spare`` is the
    cleanup's own lineage (`pids.lineage`): when it runs on this machine, the pattern
    never matches it (its command line holds the pattern, and so may its shell's).
    """
    report: Dict[str, Any] = {"stopped": [], "leftovers": [], "stale": 0, "errors": [],
                              "live": []}
    records = _sweep_records(folder, report)
    wanted = set(runs)
    selected = [r for r in records
                if _selects(r, wanted, cluster, all_runs, (keep, keep_attempt), scope)]
    if keep is not None and keep_attempt is not None:
        wanted.add(keep)  # only its earlier attempts were selected: they are this run's
    selected, targets = _triage(selected, wanted, force, by or {}, folder, report)
    hits = _pattern_hits(pattern, report, spared(spare)) if pattern else []
    stop(lambda: _sweep_members(hits, targets), grace, wait)
    for rec in selected:
        _verify_record(rec, folder, report)
    prune_empty_run_folders(folder)
    left_hits = [p for p in hits if alive(p)]
    if left_hits:
        report["leftovers"].append({"pattern": pattern, "processes": describe(left_hits)})
    return report


#: A run folder without a record and without a file is left alone this long (seconds):
#: a starting agent makes its ranks' folders just before it writes its record.
EMPTY_FOLDER_AGE = 60.0


def prune_empty_run_folders(folder: Optional[str] = None, now: Optional[float] = None) -> int:
    """Remove ``<run>@<host>`` folders that hold no file at all and no record, older than
    `EMPTY_FOLDER_AGE`: what an agent that was killed leaves of its ranks' error-file
    folders. Returns how many went; never raises (a sweep goes on without it)."""
    import shutil

    now = time.time() if now is None else now
    removed = 0
    try:
        places = [folder] if folder else registry.readable_dirs()
    except OSError:  # a foreign override (RegistryError): the sweep already said why
        return 0
    for place in places:
        try:
            names = os.listdir(place)
        except OSError:
            continue
        for name in names:
            path = os.path.join(place, name)
            if "@" not in name or os.path.lexists(path + ".json") or os.path.islink(path) \
                    or not os.path.isdir(path) or not _empty_and_old(path, now):
                continue
            with contextlib.suppress(OSError):
                shutil.rmtree(path)
                removed += 1
    return removed


def _empty_and_old(path: str, now: float) -> bool:
    """No file anywhere under ``path``, and nothing in it touched for `EMPTY_FOLDER_AGE`."""
    for root, _, files in os.walk(path):
        if any(not _is_socket(os.path.join(root, f)) for f in files):
            return False  # a socket a killed agent left is no file of the run
        try:
            if now - os.lstat(root).st_mtime < EMPTY_FOLDER_AGE:
                return False
        except OSError:
            return False
    return True


def _is_socket(path: str) -> bool:
    try:
        return stat.S_ISSOCK(os.lstat(path).st_mode)
    except OSError:
        return False


def _sweep_records(folder: Optional[str], report: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Every readable record, with why others (or the whole registry) could not be read
    put in ``report``: a sweep reports a distrusted registry instead of failing, so the
    pattern part of a cleanup still runs."""
    try:
        records, problems = read_records(folder)
    except RegistryError as exc:
        report["errors"].append(str(exc))
        records, problems = [], []
    report["errors"].extend(problems)
    return list(records)


def _selects(record: Dict[str, Any], wanted: Set[str], cluster: Optional[str],
             all_runs: bool, keep: Tuple[Optional[str], Optional[int]],
             scope: Optional[str]) -> bool:
    """Whether a sweep reaches ``record``: never the kept run (``keep``: its id, and the
    first of its attempts that is kept; None, all) nor one outside ``scope`` (those
    bounds win over any selector), then by ``all_runs``, id or cluster."""
    run, first_kept = keep
    if record["run"] == run:
        attempt = record.get("attempt", 0)
        return first_kept is not None and isinstance(attempt, int) and attempt < first_kept
    if scope is not None and record["cluster"] != scope:
        return False
    return bool(all_runs or record["run"] in wanted or (cluster and record["cluster"] == cluster))


def _triage(selected: List[Dict[str, Any]], wanted: Set[str], force: bool,
            by: Dict[str, Any], folder: Optional[str],
            report: Dict[str, Any]) -> Tuple[List[Dict[str, Any]], List[Dict[str, Any]]]:
    """(records still selected, records with processes to stop). A live run that is
    neither named nor forced is reported under ``live`` and dropped: its launcher still
    holds it. A named live run's members are taken before its agent gets the TERM, so
    the ranks it is about to stop are still counted as the sweep's."""
    kept: List[Dict[str, Any]] = []
    targets: List[Dict[str, Any]] = []
    for rec in selected:
        live = record_live(rec)
        if live and not (force or rec["run"] in wanted):
            report["live"].append({"run": rec["run"], "host": rec["host"],
                                   "launcher": launcher_of(rec)})
            continue
        kept.append(rec)
        pids = record_members(rec)
        if live:
            _stop_live_agent(rec, by, folder)
        if pids:
            targets.append(rec)
            report["stopped"].append({"run": rec["run"], "host": rec["host"],
                                      "ranks": sorted(r["rank"] for r in rec["ranks"]),
                                      "pids": pids})
        else:
            report["stale"] += 1
    return kept, targets


def _pattern_hits(pattern: str, report: Dict[str, Any], skip: Set[int]) -> List[int]:
    """Live processes of this user whose command line matches ``pattern`` (reported as
    stopped), except the cleanup's own lineage (``skip``): the explicit ``pkill -f``
    opt-in, never applied without ``--pattern``."""
    regex = re.compile(pattern)
    hits = [p for p in own_pids() if p not in skip and alive(p) and regex.search(cmdline(p))]
    if hits:
        report["stopped"].append({"pattern": pattern, "pids": hits,
                                  "cmdlines": [cmdline(p)[:200] for p in hits]})
    return hits


def _sweep_members(hits: Sequence[int], targets: Sequence[Dict[str, Any]]) -> List[int]:
    """What a sweep still has to stop, asked afresh at every step of `stop`: processes a
    TERM handler starts belong to the run too."""
    pids: Set[int] = set(p for p in hits if alive(p))
    for rec in targets:
        pids.update(record_members(rec))
    return sorted(pids)


def _verify_record(record: Dict[str, Any], folder: Optional[str],
                   report: Dict[str, Any]) -> None:
    """After the stop: report what of the run survived, or, when nothing did, remove its
    record and what goes with it. A run with survivors keeps its record, so a later
    cleanup can still find them."""
    left = record_members(record)
    if left:
        report["leftovers"].append({"run": record["run"], "host": record["host"],
                                    "processes": describe(left)})
        return
    with contextlib.suppress(OSError):
        os.unlink(record["path"])
    # Its error files and a cleanup's note go with it: nothing of the run is left.
    folder = folder or os.path.dirname(record["path"])  # where the record was found
    remove_error_files(record["run"], record["host"], folder)
    with contextlib.suppress(OSError, ValueError):
        os.unlink(_note_path(record["run"], record["host"], folder))


def _stop_live_agent(record: Dict[str, Any], by: Dict[str, Any],
                     folder: Optional[str]) -> None:
    """A live run named for stopping: tell its agent who does it, then TERM the agent,
    which stops its ranks and reports the stop to its launcher."""
    agent = record_agent(record)
    if agent is None:
        return
    write_stop_note(record["run"], record["host"], by, folder or os.path.dirname(record["path"]))
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(agent, signal.SIGTERM)


#: Re-exported: callers catch procs.RegistryError, and find processes through procs.
__all__ = ["KILL_WAIT", "RegistryError", "STOP_POLL", "adopted", "alive", "carriers", "cmdline",
           "describe", "descendants", "group_members", "own_pids", "proc_stat", "signal_pids",
           "start_time", "stat_fields", "stop"]
