"""`commands.trusted`: a folder the launcher writes to must be one no other user can
change under it (the unprivileged-user cases are in test_shared_machine_lab.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from fdl_fabric.commands.trusted import untrusted


def test_a_private_folder_and_one_still_to_be_made_are_trusted(tmp_path: Path) -> None:
    assert untrusted(str(tmp_path)) is None
    assert untrusted(str(tmp_path / "not" / "yet")) is None


def test_a_folder_anyone_can_write_is_not(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    why = untrusted(str(shared / "logs"))
    assert why is not None and f"{shared} can be written by other users (mode 777)" in why


def test_a_sticky_folder_is_trusted_only_below_a_name_of_ours(tmp_path: Path) -> None:
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    os.chmod(sticky, 0o1777)
    assert untrusted(str(sticky / "mine")) is None  # made by the launcher now
    (sticky / "mine").mkdir()
    assert untrusted(str(sticky / "mine")) is None
    why = untrusted(str(sticky))
    assert why is not None and "is shared" in why


def test_a_link_is_judged_by_where_it_leads(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    (tmp_path / "link").symlink_to(shared)
    assert untrusted(str(tmp_path / "link" / "logs")) is not None


def test_a_folder_of_roots_in_a_sticky_folder_is_trusted_for_another_user(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """In sticky /tmp, only a name's owner or root can rename it: a root-owned folder
    there is as safe for user 1000 as one of its own; another user's is not."""
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    os.chmod(sticky, 0o1777)
    (sticky / "roots").mkdir(mode=0o755)  # made by root (this test runs as root)
    (sticky / "theirs").mkdir(mode=0o755)
    os.chown(sticky / "theirs", 2000, 2000)
    monkeypatch.setattr(os, "getuid", lambda: 1000)
    assert untrusted(str(sticky / "roots" / "logs")) is None
    why = untrusted(str(sticky / "theirs" / "logs"))
    assert why is not None and "is owned by uid 2000" in why
