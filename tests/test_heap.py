"""A launch keeps its long-lived objects off Python's cycle collector while it runs
(`fdl_fabric.commands.heap`, issue 35), and gives them back when it ends: a program that
calls the launch in its own process finds its collector as it left it."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest

from fdl_fabric.api import launch
from fdl_fabric.commands.heap import long_lived
from fdl_fabric.events import Event, Name

#: A program that says, as its very last act, whether its heap was frozen for the exit.
#: Its own atexit hook is registered first, so it runs after every other one.
EXIT_PROBE = """\
import atexit, gc, os, sys
atexit.register(lambda: os.write(1, b"frozen at exit: %d\\n" % (gc.get_freeze_count() > 0)))
{body}
"""


def _exit_probe(body: str, cwd: Path) -> str:
    done = subprocess.run([sys.executable, "-c", EXIT_PROBE.format(body=body)], cwd=cwd,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=60,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    return done.stdout


@pytest.fixture
def collector() -> Iterator[None]:
    """Whatever a test does to the collector is undone after it."""
    enabled = gc.isenabled()
    gc.unfreeze()
    try:
        yield
    finally:
        gc.unfreeze()
        if enabled:
            gc.enable()


def test_what_exists_when_the_launch_settles_is_out_of_the_collectors_walks(
        collector: None) -> None:
    kept = [{"rank": r} for r in range(100)]
    with long_lived() as heap:
        assert gc.get_freeze_count() == 0
        heap.settle()
        frozen = gc.get_freeze_count()
        assert frozen >= len(kept)
    assert gc.get_freeze_count() == 0, "given back to the collector at the launch's end"


def test_a_cycle_made_garbage_during_the_launch_is_collected_after_it(
        collector: None) -> None:
    class Node:
        other: object = None

    with long_lived() as heap:
        a, b = Node(), Node()
        a.other, b.other = b, a
        seen = weakref.ref(a)
        heap.settle()
        del a, b
        gc.collect()
        assert seen() is not None, "frozen: not walked"
    gc.collect()
    assert seen() is None


def test_a_program_that_froze_its_own_heap_is_left_as_it_is(collector: None) -> None:
    gc.freeze()
    before = gc.get_freeze_count()
    with long_lived() as heap:
        heap.settle()
        assert not heap.owned
    assert gc.get_freeze_count() == before, "its freeze is not undone under it"


def test_a_program_that_turned_the_collector_off_is_left_as_it_is(collector: None) -> None:
    gc.disable()
    with long_lived() as heap:
        heap.settle()
        assert gc.get_freeze_count() == 0
    assert not gc.isenabled()


def test_a_real_launch_runs_its_ranks_with_its_heap_frozen_and_gives_it_back(
        collector: None, runs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    frozen_at_start: list[int] = []

    def seen(e: Event) -> None:
        if e.name is Name.RANK_STARTED:
            frozen_at_start.append(gc.get_freeze_count())

    result = launch(None, [sys.executable, "-c", "print('hi')"], hosts="localhost",
                    nproc_per_node=2, quiet=True, on_event=seen)
    assert result.exit_code == 0
    assert len(frozen_at_start) == 2 and min(frozen_at_start) > 0
    assert gc.get_freeze_count() == 0


def test_a_command_leaves_its_heap_to_the_os_at_the_programs_exit(tmp_path: Path) -> None:
    """The interpreter's teardown walks no cycle over what the command held: `gc.freeze`
    as the exit begins (60-110 ms of every launch's exit on the lab's machine)."""
    out = _exit_probe("from fdl_fabric.commands.cli import main\n"
                      "sys.argv = ['fdl-fabric', 'launch', '--cluster', 'missing.yml']\n"
                      "main()", tmp_path)
    assert out.endswith("frozen at exit: 1\n")
    assert "missing.yml" in out  # the task ran, and refused the file it was given


def test_a_program_that_only_imports_the_tasks_or_calls_the_launch_keeps_its_exit(
        tmp_path: Path) -> None:
    """Only a task's run (the program's last act is then a command's) asks for it: a
    program that imports the collection, or calls the launch as a library, exits as ever."""
    out = _exit_probe("import fdl_fabric.tasks\n"
                      "from fdl_fabric.api import launch\n"
                      "r = launch(None, [sys.executable, '-c', 'pass'], hosts='localhost',\n"
                      "           nproc_per_node=1, quiet=True)\n"
                      "print('exit code', r.exit_code)", tmp_path)
    assert out.endswith("exit code 0\nfrozen at exit: 0\n")
