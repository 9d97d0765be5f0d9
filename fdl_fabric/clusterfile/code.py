"""The blocks of cluster.yml about code and environment: ``sync``, ``setup`` (with
``setup_inputs`` and ``setup_timeout``), ``python``, ``check_packages`` and
``strict_versions`` (docs/code-and-environment.md).

Kept apart from `schema` because they describe what the hosts *run*, not how they are
reached; `schema.read_cluster` calls `read_code` once and puts what it returns on the
`ClusterSpec`.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Optional

from yaml.nodes import ScalarNode

from ..limits import SECONDS_MAX
from .model import SetupSpec, SyncSpec, VersionsSpec
from .names import command_problem
from .yamlread import Block, Field, NodeReader, line_of

#: The top-level keys this module reads.
CODE_KEYS = ("sync", "setup", "setup_inputs", "setup_timeout", "python", "check_packages",
             "strict_versions")
_SYNC_KEYS = ("src", "exclude")
#: Patterns in ``sync.exclude`` and files in ``setup_inputs``, at most.
PATTERNS_MAX = 1024
#: ``setup_timeout`` unless the file says otherwise: a venv with torch takes minutes.
SETUP_TIMEOUT_DEFAULT = SetupSpec.timeout
#: A package name as PyPI spells them (PEP 508's name), so it can go into a probe as is.
_PACKAGE_RE = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,98}[A-Za-z0-9])?")


@dataclass(frozen=True)
class CodeBlocks:
    """What `read_code` found; None or defaults for what the file leaves out."""

    sync: Optional[SyncSpec] = None
    setup: Optional[SetupSpec] = None
    python: Optional[str] = None
    versions: VersionsSpec = VersionsSpec()


def read_code(r: NodeReader, top: Block, folder: str) -> CodeBlocks:
    """Every code-and-environment key of the top level, each problem with its line."""
    python = read_python(r, top.field("python"))
    sync = _read_sync(r, top.field("sync"), folder)
    setup = _read_setup(r, top)
    sync_node = top.field("sync").node
    switched_off = sync_node is None or (isinstance(sync_node, ScalarNode)
                                         and r.scalar(sync_node) is False)
    if setup is not None and switched_off:
        r.problem(top.field("setup"), "setup runs in the synced folder: add sync: true (or "
                  "a sync: mapping), or remove setup")
    return CodeBlocks(sync=sync, setup=setup, python=python,
                      versions=_read_versions(r, top))


def read_python(r: NodeReader, field: Field) -> Optional[str]:
    """``python``: an interpreter, a path (relative to the ranks' folder) or a name on
    the host's PATH; one word, since it replaces the first word of a command."""
    value = r.path(field)
    if value is None:
        return None
    if value.startswith("~"):
        r.problem(field, f"is run as written, and ~ is not expanded there: use a path "
                  f"relative to the ranks' folder or an absolute one, got {value!r}")
        return None
    if any(c.isspace() for c in value):
        r.problem(field, f"is one interpreter (a path or a name), got {value!r}; put its "
                  "arguments in command")
        return None
    return value


def default_sync(src: str) -> SyncSpec:
    """``--sync`` without a ``sync:`` block: ``src`` (the cluster file's folder, or the
    current one for ``fdl-fabric run``), nothing excluded beyond the rules."""
    return SyncSpec(src=os.path.abspath(src))


def _read_sync(r: NodeReader, field: Field, folder: str) -> Optional[SyncSpec]:
    node = field.node
    if node is None:
        return None
    value = r.scalar(node) if isinstance(node, ScalarNode) else None
    if isinstance(value, bool):
        return SyncSpec(src=folder, line=line_of(node)) if value else None
    block = r.block(field, _SYNC_KEYS, what="true, false, or a mapping with src and exclude")
    if block is None:
        return None
    src = folder
    src_field = block.field("src")
    raw = r.path(src_field)
    if raw is not None:
        src = os.path.normpath(os.path.join(folder, os.path.expanduser(raw)))
    excludes: list[str] = []
    exclude_field = block.field("exclude")
    items = r.sequence(exclude_field, expected="a list of patterns, e.g. [data/, '*.ckpt']")
    if items is not None and len(items) > PATTERNS_MAX:
        r.problem(exclude_field, f"lists {len(items)} patterns; at most {PATTERNS_MAX}")
        items = None
    for i, item in enumerate(items or []):
        pattern = r.path(Field(item, f"{exclude_field.key}[{i}]"))
        if pattern is not None:
            excludes.append(pattern)
    return SyncSpec(src=src, exclude=tuple(excludes), line=line_of(node))


def _read_setup(r: NodeReader, top: Block) -> Optional[SetupSpec]:
    field = top.field("setup")
    command = r.string(field)
    if command is not None:
        command = r.checked(field, command, "setup", command_problem)
    inputs_field = top.field("setup_inputs")
    inputs: list[str] = []
    items = r.sequence(inputs_field, expected="a list of files, e.g. [requirements.txt]")
    if items is not None and len(items) > PATTERNS_MAX:
        r.problem(inputs_field, f"lists {len(items)} files; at most {PATTERNS_MAX}")
        items = None
    for i, item in enumerate(items or []):
        item_field = Field(item, f"{inputs_field.key}[{i}]")
        name = r.path(item_field)
        if name is None:
            continue
        if os.path.isabs(name) or ".." in name.split("/"):
            r.problem(item_field, f"names a file of the synced folder, relative to it; got "
                      f"{name!r}")
            continue
        inputs.append(os.path.normpath(name))
    timeout_field = top.field("setup_timeout")
    timeout = r.number(timeout_field, minimum=0.0, exclusive=True, maximum=SECONDS_MAX)
    if command is None:
        for key, f in (("setup_inputs", inputs_field), ("setup_timeout", timeout_field)):
            if f.node is not None and field.node is None:
                r.problem(f, f"{key} goes with setup: (the command it is about); add setup "
                          "or remove it")
        return None
    return SetupSpec(command=command, inputs=tuple(inputs),
                     timeout=SETUP_TIMEOUT_DEFAULT if timeout is None else timeout,
                     line=line_of(field.node) if field.node is not None else 0)


def _read_versions(r: NodeReader, top: Block) -> VersionsSpec:
    field = top.field("check_packages")
    packages: Optional[tuple[str, ...]] = None
    items = r.sequence(field, expected="a list of package names, e.g. [torch, numpy]")
    if items is not None:
        names: list[str] = []
        for i, item in enumerate(items[:PATTERNS_MAX]):
            item_field = Field(item, f"{field.key}[{i}]")
            name = r.string(item_field)
            if name is None:
                continue
            if not _PACKAGE_RE.fullmatch(name):
                r.problem(item_field, f"is not a package name (letters, digits, . _ -): "
                          f"{name!r}")
                continue
            names.append(name)
        packages = tuple(names)
    strict = r.boolean(top.field("strict_versions"))
    return VersionsSpec(packages=packages, strict=bool(strict))
