"""The controller's cache of built agent payloads: read back by content, trusted only
when it is this user's own, bounded in count (`fdl_fabric.transport.bundlecache`)."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import pytest

from fdl_fabric.transport import bundle, bundlecache


class Builds:
    """A build that counts its calls."""

    def __init__(self, data: bytes = b"payload") -> None:
        self.data = data
        self.calls = 0

    def __call__(self) -> bytes:
        self.calls += 1
        return self.data


def test_a_payload_is_built_once_then_read_back_from_a_private_file(tmp_path: Path) -> None:
    folder = str(tmp_path / "cache" / "agent")
    build = Builds()
    assert bundlecache.cached("k1", build, folder) == b"payload"
    assert bundlecache.cached("k1", build, folder) == b"payload"
    assert build.calls == 1
    kept = Path(folder) / "payload-k1.bin"
    assert stat.S_IMODE(kept.stat().st_mode) == 0o600
    assert stat.S_IMODE(Path(folder).stat().st_mode) == 0o700
    assert not [p for p in Path(folder).iterdir() if p.name.endswith(".tmp")]


def test_another_key_builds_afresh(tmp_path: Path) -> None:
    folder = str(tmp_path / "agent")
    bundlecache.cached("k1", Builds(b"one"), folder)
    other = Builds(b"two")
    assert bundlecache.cached("k2", other, folder) == b"two" and other.calls == 1


def test_a_kept_payload_others_may_write_is_not_trusted(tmp_path: Path) -> None:
    folder = str(tmp_path / "agent")
    bundlecache.cached("k1", Builds(b"good"), folder)
    kept = Path(folder) / "payload-k1.bin"
    kept.write_bytes(b"planted")
    os.chmod(kept, 0o622)
    build = Builds(b"good")
    assert bundlecache.cached("k1", build, folder) == b"good" and build.calls == 1


def test_a_kept_payload_that_is_a_link_is_not_followed(tmp_path: Path) -> None:
    folder = tmp_path / "agent"
    bundlecache.cached("k0", Builds(), str(folder))  # makes the folder
    elsewhere = tmp_path / "elsewhere.bin"
    elsewhere.write_bytes(b"planted")
    os.chmod(elsewhere, 0o600)
    (folder / "payload-k1.bin").symlink_to(elsewhere)
    build = Builds(b"good")
    assert bundlecache.cached("k1", build, str(folder)) == b"good" and build.calls == 1


def test_a_cache_folder_that_is_a_link_is_neither_read_nor_written(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    (real / "payload-k1.bin").write_bytes(b"planted")
    os.chmod(real / "payload-k1.bin", 0o600)
    link = tmp_path / "agent"
    link.symlink_to(real)
    build = Builds(b"good")
    assert bundlecache.cached("k1", build, str(link)) == b"good"
    assert bundlecache.cached("k1", build, str(link)) == b"good"
    assert build.calls == 2
    assert (real / "payload-k1.bin").read_bytes() == b"planted"


def test_only_the_newest_payloads_are_kept(tmp_path: Path) -> None:
    folder = tmp_path / "agent"
    for n in range(bundlecache.KEPT + 3):
        bundlecache.cached(f"k{n}", Builds(), str(folder))
        past = time.time() - 100 + n
        os.utime(folder / f"payload-k{n}.bin", (past, past))
    kept = sorted(p.name for p in folder.iterdir())
    newest = range(3, bundlecache.KEPT + 3)
    assert kept == sorted(f"payload-k{n}.bin" for n in newest)


def test_the_launchers_payload_is_the_same_built_or_read_back(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    bundle.payload.cache_clear()
    try:
        first = bundle.payload()
        assert list((tmp_path / "fdl-fabric" / "agent").iterdir())
        bundle.payload.cache_clear()
        assert bundle.payload() == first
    finally:
        bundle.payload.cache_clear()
