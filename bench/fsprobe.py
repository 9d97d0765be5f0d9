"""What the file system under a run's records costs a rank, said beside a bench's figures.

Why: a launch makes a folder and two files for every rank (`fdl_fabric.presentation.
runlog`), and at 8,192 ranks the kernel's time for them is a large part of the
launcher's CPU. On some file systems that time depends on what was deleted a few
minutes before: ext4 without a journal (this machine's root) skips every inode freed in
the last 60 to 300 s when it allocates one (the kernel's ``recently_deleted``), so after
an ``rm -rf`` of a big folder each new inode costs hundreds of microseconds, and a few
minutes later tens. A figure read without this cannot be compared with another.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def mount_of(path: Path) -> tuple[str, str, str]:
    """(mount point, file system type, source) of the mount that holds ``path``."""
    target = os.path.realpath(path)
    best = ("/", "?", "?")
    with open("/proc/self/mountinfo", encoding="utf-8") as fh:
        for line in fh:
            left, _, right = line.partition(" - ")
            point = left.split()[4].replace("\\040", " ")
            fstype, source = (right.split() + ["?", "?"])[:2]
            inside = target == point or target.startswith(point.rstrip("/") + "/")
            if inside and len(point) >= len(best[0]):
                best = (point, fstype, source)
    return best


def journal_note(fstype: str, source: str) -> str:
    """``, no journal`` for an ext4 without one (`/sys/fs/ext4/<dev>/journal_task`)."""
    if fstype != "ext4":
        return ""
    task = Path("/sys/fs/ext4") / os.path.basename(source) / "journal_task"
    try:
        text = task.read_text().strip()
    except OSError:
        return ""
    return " without a journal (an inode freed in the last 60-300 s is skipped, one by " \
           "one, each time one is made)" if text in ("", "<none>") else ""


def rank_cost_us(root: Path, ranks: int = 256) -> float:
    """System time, in microseconds, to make ``ranks`` ranks' folder and two files under
    ``root``, as a launch does, per rank. The probe's files are kept until ``root`` is
    removed with the rest: deleting them now would slow the launch that follows."""
    root.mkdir(parents=True, exist_ok=True)
    folder = tempfile.mkdtemp(prefix="fsprobe-", dir=root)
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC
    before = os.times()
    for rank in range(ranks):
        path = f"{folder}/r{rank}"
        os.mkdir(path, 0o700)
        for name in ("stdout.log", "stderr.log"):
            os.close(os.open(f"{path}/{name}", flags, 0o600))
    after = os.times()
    return (after.system - before.system) / ranks * 1e6


def describe(runs_dir: Path) -> str:
    """A line for the bench's output: where the records go, and their cost now."""
    point, fstype, source = mount_of(runs_dir)
    cost = rank_cost_us(runs_dir / ".fsprobe")
    return (f"run records in {runs_dir} ({fstype} on {source}, mounted at {point}"
            f"{journal_note(fstype, source)}); a rank's folder and two files took "
            f"{cost:.0f} us of system time just before the run (256 made)")


__all__ = ["describe", "journal_note", "mount_of", "rank_cost_us"]
