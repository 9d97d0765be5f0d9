"""A worker's ``transport:`` key: which kind of `fdl_fabric.transport` reaches it.

Either a name (``transport: ssh``) or a block with the kind and its own settings
(``transport: {kind: kubectl, namespace: train}``). The file reader checks only the
shape: a kind's name is a short lowercase word, its settings plain values (strings,
numbers, booleans, lists and mappings of them). Which names exist, and what a kind's
settings must hold, are the transport package's to say (`transport.check_kinds`, exit 2
at this key), because a plug-in registers kinds the reader has never heard of. Omitted,
the kind is inferred from the host (`transport.kinds`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Optional

from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from .yamlread import Field, NodeReader

#: A kind's name: what a class's ``kind`` may be.
KIND_RE = re.compile(r"[a-z][a-z0-9_-]{0,31}")


def read_transport(r: NodeReader, field: Field) -> tuple[Optional[str], Mapping[str, Any]]:
    """The kind named (None when the key is absent) and its settings (empty for a name)."""
    if field.node is None:
        return None, {}
    if isinstance(field.node, MappingNode):
        return _read_block(r, field)
    return _kind_name(r, field), {}


def _kind_name(r: NodeReader, field: Field) -> Optional[str]:
    name = r.string(field)
    if name is None:
        return None
    if not KIND_RE.fullmatch(name):
        r.problem(field, f"a transport is named by a short lowercase word (local, ssh, "
                  f"slurm, or a plug-in's), got {name!r}")
        return None
    return name


def _read_block(r: NodeReader, field: Field) -> tuple[Optional[str], Mapping[str, Any]]:
    block = r.mapping(field, "a kind's name, or a mapping with `kind:` and its settings")
    if block is None:
        return None, {}
    if not block.has("kind"):
        r.problem(field, "a transport block names its kind: `kind: NAME`, then its settings")
        return None, {}
    name = _kind_name(r, block.field("kind"))
    settings = {key: _plain(r, Field(value, block.key(key)))
                for key, (_, value) in block.entries.items() if key != "kind"}
    return name, settings


def _plain(r: NodeReader, field: Field) -> Any:
    """A settings value as plain Python, each scalar by the reader's own rules."""
    node: Node = field.node  # type: ignore[assignment]
    if isinstance(node, ScalarNode):
        return r.scalar(node)
    if isinstance(node, SequenceNode):
        return [_plain(r, Field(item, f"{field.key}[{i}]"))
                for i, item in enumerate(node.value)]
    block = r.mapping(field)
    if block is None:
        return None
    return {key: _plain(r, Field(value, block.key(key)))
            for key, (_, value) in block.entries.items()}
