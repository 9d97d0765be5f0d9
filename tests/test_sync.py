"""Issue 31: what a sync sends and how a host keeps it, without a host: the manifest
(`fdl_fabric.sync.manifest`), the host's store (`fdl_fabric.agent.codestore`, driven as
its agent drives it), the gateway's feeder, the setup key and the cluster file's keys."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from fdl_fabric.agent import codestore, feeder, wire
from fdl_fabric.clusterfile import ConfigError, parse_cluster
from fdl_fabric.clusterfile.model import SetupSpec, SyncSpec
from fdl_fabric.errors import FdlError
from fdl_fabric.sync import manifest as manifests
from fdl_fabric.sync.push import CHUNK
from fdl_fabric.sync.setup import setup_key


def _git(folder: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(folder), "-c", "user.name=t", "-c", "user.email=t@t",
                    *args], check=True, capture_output=True)


def _tree(root: Path) -> Path:
    (root / "pkg").mkdir(parents=True)
    (root / "train.py").write_text("print('hi')\n")
    (root / "pkg" / "mod.py").write_text("X = 1\n")
    (root / "run.sh").write_text("#!/bin/sh\n")
    (root / "run.sh").chmod(0o755)
    return root


def build(root: Path, tmp: Path, **kw: Any) -> manifests.Manifest:
    return manifests.build(SyncSpec(src=str(root), **kw), cache_dir=tmp / "cache")


def rels(m: manifests.Manifest) -> set[str]:
    return {e.rel for e in m.entries if e.kind != "d"}


# -- the manifest ---------------------------------------------------------------------------

def test_the_manifest_lists_files_with_their_modes_and_content_hashes(tmp_path: Path) -> None:
    src = _tree(tmp_path / "src")
    m = build(src, tmp_path)
    by = {e.rel: e for e in m.entries}
    assert rels(m) == {"train.py", "pkg/mod.py", "run.sh"}
    assert by["pkg"].kind == "d"
    assert by["run.sh"].mode == 0o755 and by["train.py"].size == len("print('hi')\n")
    assert m.code_id == f"tree:{m.tree}"


def test_the_tree_id_follows_content_and_modes_not_mtimes(tmp_path: Path) -> None:
    src = _tree(tmp_path / "src")
    first = build(src, tmp_path).tree
    os.utime(src / "train.py", (1, 1))
    assert build(src, tmp_path).tree == first
    (src / "train.py").chmod(0o700)
    assert build(src, tmp_path).tree != first


def test_excludes_the_ignore_file_and_the_never_sent_rules_are_honoured(tmp_path: Path) -> None:
    src = _tree(tmp_path / "src")
    (src / "data").mkdir()
    (src / "data" / "x.bin").write_bytes(b"x")
    (src / "w.ckpt").write_bytes(b"w")
    (src / "notes.tmp").write_text("t")
    (src / manifests.IGNORE_FILE).write_text("*.tmp\n")
    (src / "__pycache__").mkdir()
    (src / "__pycache__" / "a.pyc").write_bytes(b"c")
    (src / "logs").mkdir()
    (src / "logs" / "run.log").write_text("l")
    m = manifests.build(SyncSpec(src=str(src), exclude=("data/", "*.ckpt")),
                        never=[str(src / "logs")], cache_dir=tmp_path / "cache")
    assert rels(m) == {"train.py", "pkg/mod.py", "run.sh", manifests.IGNORE_FILE}
    assert m.excluded >= 5


def test_in_a_git_work_tree_gitignore_holds_git_is_never_sent_and_the_code_id_is_the_commit(
        tmp_path: Path) -> None:
    src = _tree(tmp_path / "src")
    (src / ".gitignore").write_text("*.log\n")
    (src / "debug.log").write_text("x")
    _git(src, "init", "-q")
    _git(src, "add", "-A")
    _git(src, "commit", "-q", "-m", "c")
    head = subprocess.run(["git", "-C", str(src), "rev-parse", "--short=12", "HEAD"],
                          capture_output=True, text=True, check=True).stdout.strip()
    m = build(src, tmp_path)
    assert "debug.log" not in rels(m) and not any(r.startswith(".git/") for r in rels(m))
    assert m.code_id == f"git:{head}"
    (src / "train.py").write_text("print('changed')\n")
    changed = build(src, tmp_path)
    assert changed.code_id == f"git:{head}+{changed.tree[:8]}"
    (src / "new.py").write_text("untracked but not ignored: sent\n")
    assert "new.py" in rels(build(src, tmp_path))


def test_a_symlink_inside_is_kept_and_one_out_of_the_folder_is_refused_by_its_path(
        tmp_path: Path) -> None:
    src = _tree(tmp_path / "src")
    (src / "alias.py").symlink_to("pkg/mod.py")
    (src / "abs.py").symlink_to(src / "train.py")
    by = {e.rel: e for e in build(src, tmp_path).entries}
    assert (by["alias.py"].kind, by["alias.py"].ref) == ("l", "pkg/mod.py")
    assert by["abs.py"].ref == "train.py"  # made relative: the host's folder is elsewhere
    (tmp_path / "secret").write_text("s")
    (src / "out").symlink_to(tmp_path / "secret")
    with pytest.raises(FdlError) as caught:
        build(src, tmp_path)
    assert caught.value.exit_code == 2
    assert f"{src / 'out'} is a symlink to {tmp_path / 'secret'}, outside {src}" in \
        str(caught.value)


def test_a_missing_src_is_refused_naming_it(tmp_path: Path) -> None:
    with pytest.raises(FdlError) as caught:
        manifests.build(SyncSpec(src=str(tmp_path / "nope"), line=7))
    assert caught.value.exit_code == 2
    assert f"{tmp_path / 'nope'} (sync.src, line 7) is not a folder" in str(caught.value)


def test_unchanged_files_are_not_hashed_again(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    src = _tree(tmp_path / "src")
    for p in src.rglob("*"):
        os.utime(p, (1000, 1000))  # old enough not to be racy
    build(src, tmp_path)
    hashed: list[str] = []
    real = manifests._hash_file
    monkeypatch.setattr(manifests, "_hash_file", lambda p: hashed.append(p) or real(p))
    build(src, tmp_path)
    assert hashed == []
    (src / "train.py").write_text("print('new')\n")
    os.utime(src / "train.py", (2000, 2000))
    build(src, tmp_path)
    assert hashed == [str(src / "train.py")]


# -- the host's store, driven as its agent drives it -----------------------------------------

def _frames(m: manifests.Manifest, need: list[int], src: Path) -> list[bytes]:
    out = []
    for i in need:
        data = (src / m.entries[i].rel).read_bytes()
        pieces = [data[k:k + CHUNK] for k in range(0, len(data), CHUNK)] or [b""]
        for n, piece in enumerate(pieces):
            flags = codestore.LAST if n == len(pieces) - 1 else 0
            out.append(codestore.DATA_HEAD.pack(i, flags) + piece)
    return out


def begun(store: codestore.Store, m: manifests.Manifest) -> dict[str, Any]:
    """The two questions an agent answers: has it the tree? then, what does it lack?"""
    if store.ask(m.tree):
        return {"have": True, "need": []}
    return store.begin({"entries": m.wire()})


def sync(m: manifests.Manifest, src: Path, path: Path) -> tuple[dict[str, Any], Any]:
    store = codestore.Store(str(path))
    need = begun(store, m)
    for body in _frames(m, need["need"], src):
        store.receive(body)
    assert store.complete
    return need, store.finish()


def test_a_host_receives_only_what_it_lacks_and_builds_the_tree_with_modes_and_links(
        tmp_path: Path) -> None:
    src = _tree(tmp_path / "src")
    (src / "alias.py").symlink_to("pkg/mod.py")
    (src / "big.bin").write_bytes(os.urandom(3 * CHUNK + 5))
    host = tmp_path / "host"
    m = build(src, tmp_path)
    need, done = sync(m, src, host)
    assert len(need["need"]) == 4 and not need["have"]
    tree = Path(done["dir"])
    assert tree == host / ".fdl-code" / "trees" / m.tree
    assert (tree / "big.bin").read_bytes() == (src / "big.bin").read_bytes()
    assert os.access(tree / "run.sh", os.X_OK) and os.readlink(tree / "alias.py") == "pkg/mod.py"
    assert os.readlink(host / ".fdl-code" / "current") == f"trees/{m.tree}"
    again, _ = sync(m, src, host)
    assert again["have"] and again["need"] == []
    (src / "train.py").write_text("print('v2')\n")
    m2 = build(src, tmp_path)
    need2, done2 = sync(m2, src, host)
    assert [m2.entries[i].rel for i in need2["need"]] == ["train.py"]
    assert Path(done["dir"], "train.py").read_text() == "print('hi')\n"  # v1 untouched
    assert Path(done2["dir"], "train.py").read_text() == "print('v2')\n"
    assert os.stat(Path(done2["dir"], "big.bin")).st_ino == os.stat(tree / "big.bin").st_ino


def test_a_file_that_changed_while_it_was_sent_is_refused_not_stored(tmp_path: Path) -> None:
    src = _tree(tmp_path / "src")
    m = build(src, tmp_path)
    store = codestore.Store(str(tmp_path / "host"))
    need = begun(store, m)
    index = next(i for i in need["need"] if m.entries[i].rel == "train.py")
    with pytest.raises(codestore.StoreError, match="train.py changed while it was sent"):
        store.receive(codestore.DATA_HEAD.pack(index, codestore.LAST) + b"print('HI')\n")
    assert not list((tmp_path / "host" / ".fdl-code" / "objects").rglob("*.*"))


def test_a_manifest_path_outside_the_tree_is_refused(tmp_path: Path) -> None:
    store = codestore.Store(str(tmp_path / "host"))
    assert not store.ask("abc")
    for rel in ("../x", "/etc/passwd", "a/../../b", ""):
        with pytest.raises(codestore.StoreError, match="outside the folder"):
            store.begin({"entries": [[rel, "f", 0o644, 1, "0" * 64, 0]]})


def test_not_enough_space_is_said_with_the_free_space(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    src = _tree(tmp_path / "src")
    m = build(src, tmp_path)
    store = codestore.Store(str(tmp_path / "host"))
    monkeypatch.setattr(store, "free", lambda: 1024)
    with pytest.raises(codestore.StoreError, match=r"not enough space under .*: the sync "
                       r"needs .*, 1\.0 KiB free"):
        begun(store, m)


def test_old_trees_nobody_runs_are_collected_and_a_held_one_is_kept(tmp_path: Path) -> None:
    src = _tree(tmp_path / "src")
    host = tmp_path / "host"
    dirs = []
    held = None
    for n in range(codestore.KEEP_TREES + 3):
        (src / "train.py").write_text(f"print({n})\n")
        store = codestore.Store(str(host))
        m = build(src, tmp_path)
        need = begun(store, m)
        for body in _frames(m, need["need"], src):
            store.receive(body)
        done = store.finish()
        store.collect()  # as its agent does, once it answered
        dirs.append(Path(done["dir"]))
        if n == 0:
            held = store  # its lock stays held, as an agent running that tree holds it
        elif store.lock_fd is not None:
            os.close(store.lock_fd)
    assert held is not None and dirs[0].is_dir(), "a tree in use is never collected"
    assert not dirs[1].exists() and dirs[-1].is_dir()
    kept = [d for d in dirs if d.exists()]
    assert len(kept) <= codestore.KEEP_TREES + 1
    objects = list((host / ".fdl-code" / "objects").rglob("*.*"))
    assert all(o.stat().st_nlink > 1 for o in objects), "an object no tree links is removed"


# -- the gateway's feeder ------------------------------------------------------------------

def test_the_feeder_sends_a_leaf_the_same_frames_the_launcher_would(tmp_path: Path) -> None:
    data = os.urandom(2 * feeder.CHUNK + 10)
    (tmp_path / "obj").write_bytes(data)
    feed = feeder.Feeder([(7, str(tmp_path / "obj"))])
    reader = wire.Reader(frozenset({wire.SYNC_DATA}))
    got = b""
    while not feed.done:
        for kind, body in reader.feed(feed.next_frame()):
            index, flags = codestore.DATA_HEAD.unpack_from(body)
            assert (kind, index) == (wire.SYNC_DATA, 7)
            got += body[codestore.DATA_HEAD.size:]
    assert got == data and flags == codestore.LAST


def test_serve_names_entries_and_the_relay_finds_their_objects_in_the_kept_manifest(
        tmp_path: Path) -> None:
    src = _tree(tmp_path / "src")
    m = build(src, tmp_path)
    kept = wire.frame(wire.SYNC_MANIFEST, json.dumps({"entries": m.wire()}).encode())
    index = next(i for i, e in enumerate(m.entries) if e.rel == "train.py")
    [(got, path)] = feeder.objects_of(kept, "/srv/p/.fdl-code", [index])
    sha = m.entries[index].ref
    assert (got, path) == (index, f"/srv/p/.fdl-code/objects/{sha[:2]}/{sha}.644")


def test_the_frame_cut_knows_when_no_launcher_frame_is_half_written() -> None:
    cut = feeder.FrameCut()
    frame = wire.message(wire.PING, {"x": 1})
    for i in range(len(frame)):
        cut.advance(frame[i:i + 1])
        assert cut.between == (i == len(frame) - 1)
    cut.advance(frame[:2])
    assert not cut.between
    cut.advance(frame[2:] + frame)
    assert cut.between


# -- setup's key and the cluster file ------------------------------------------------------

def test_setup_runs_again_only_when_its_command_or_its_inputs_change(tmp_path: Path) -> None:
    src = _tree(tmp_path / "src")
    (src / "requirements.txt").write_text("torch\n")
    spec = SetupSpec(command="pip install -r requirements.txt", inputs=("requirements.txt",))
    key = setup_key(spec, build(src, tmp_path))
    (src / "train.py").write_text("print('code changed')\n")
    assert setup_key(spec, build(src, tmp_path)) == key
    (src / "requirements.txt").write_text("torch==2.13.0\n")
    assert setup_key(spec, build(src, tmp_path)) != key
    other = SetupSpec(command="pip install -U -r requirements.txt", inputs=spec.inputs)
    assert setup_key(other, build(src, tmp_path)) != setup_key(spec, build(src, tmp_path))


_WORKER = "workers:\n  - host: localhost\n    nproc: 1\n"


def _parse(text: str, tmp_path: Path) -> Any:
    return parse_cluster(text, file=str(tmp_path / "cluster.yml"), folder=str(tmp_path))


def test_the_code_keys_are_read_with_their_defaults(tmp_path: Path) -> None:
    c = _parse(_WORKER + "sync:\n  src: code\n  exclude: [data/]\nsetup: make\n"
               "setup_inputs: [requirements.txt]\npython: .venv/bin/python\n"
               "check_packages: [torch, numpy]\nstrict_versions: true\n", tmp_path)
    assert c.sync == SyncSpec(src=str(tmp_path / "code"), exclude=("data/",), line=5)
    assert (c.setup.command, c.setup.inputs, c.setup.timeout) == \
        ("make", ("requirements.txt",), 1800.0)
    assert c.python == ".venv/bin/python"
    assert (c.versions.packages, c.versions.strict) == (("torch", "numpy"), True)
    assert _parse(_WORKER + "sync: true\n", tmp_path).sync.src == str(tmp_path)
    assert _parse(_WORKER + "sync: false\n", tmp_path).sync is None


@pytest.mark.parametrize(("text", "words"), [
    ("setup: make\n", ":4: setup: setup runs in the synced folder: add sync: true"),
    ("sync: true\nsetup_timeout: 5\n", "setup_timeout goes with setup:"),
    ("sync: true\nsetup: make\nsetup_inputs: [../x]\n", "names a file of the synced folder"),
    ("python: ~/venv/bin/python\n", "~ is not expanded there"),
    ("python: python3 -u\n", "is one interpreter"),
    ("check_packages: ['a b']\n", "is not a package name"),
    ("sync: {srcs: .}\n", "unknown key 'srcs' (did you mean 'src'?)"),
])
def test_a_code_key_written_wrong_is_refused_naming_it(text: str, words: str,
                                                      tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        _parse(_WORKER + text, tmp_path)
    assert words in str(caught.value)


def test_a_sync_is_refused_with_on_since_only_the_cluster_file_goes_there(
        tmp_path: Path) -> None:
    from fdl_fabric.commands.onhost import refuse_sync

    with pytest.raises(FdlError) as caught:
        refuse_sync("head", {"sync": True}, None)
    assert caught.value.exit_code == 2 and "--on: sync sends a folder of this machine" in \
        str(caught.value)
    cluster = tmp_path / "cluster.yml"
    cluster.write_text(_WORKER + "sync: true\n")
    with pytest.raises(FdlError):
        refuse_sync("head", {}, str(cluster))
    refuse_sync("head", {"no_sync": True}, str(cluster))  # said: run what head has
    cluster.write_text(_WORKER)
    refuse_sync("head", {}, str(cluster))
