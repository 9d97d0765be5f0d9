"""A launch keeps its long-lived objects off Python's cycle collector while it runs
(`fdl_fabric.commands.heap`, issue 35), and gives them back when it ends: a program that
calls the launch in its own process finds its collector as it left it."""

from __future__ import annotations

import gc
import sys
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest

from fdl_fabric.api import launch
from fdl_fabric.commands.heap import long_lived
from fdl_fabric.events import Event, Name


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
