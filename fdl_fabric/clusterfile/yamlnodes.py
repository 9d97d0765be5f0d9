"""The YAML node tree of a cluster file: composed with bounds, and named as the user wrote it.

Why nodes rather than ``yaml.safe_load``: see `yamlread`. Here is what knows YAML's tree
itself: the tags and what to call them (`describe`), a key path (`Field`, `Block`), and
`compose`, which turns text into nodes with its size, its characters and its nesting
bounded before PyYAML's recursion can overflow, a syntax error becoming one located
`Problem`. Nothing here constructs a value.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Optional

import yaml
from yaml.composer import Composer
from yaml.events import Event, MappingStartEvent, SequenceStartEvent
from yaml.nodes import MappingNode, Node, ScalarNode
from yaml.parser import Parser
from yaml.reader import Reader, ReaderError
from yaml.resolver import Resolver
from yaml.scanner import Scanner

from ..limits import DEPTH_MAX, FILE_MAX_BYTES, NUMBER_MAX_CHARS
from .names import SHOWN_MAX, clip, shown
from .problems import Problem, file_too_big, make_problem

TAG = "tag:yaml.org,2002:"
KIND_BY_TAG = {
    TAG + "str": "string",
    TAG + "int": "integer",
    TAG + "float": "float",
    TAG + "bool": "boolean",
    TAG + "null": "null",
    TAG + "timestamp": "timestamp",
    TAG + "binary": "binary",
    TAG + "map": "a mapping",
    TAG + "seq": "a list",
}
SCALAR_TAGS = frozenset(tag for tag in KIND_BY_TAG if tag not in (TAG + "map", TAG + "seq"))
NUMBER_TAGS = frozenset({TAG + "int", TAG + "float"})
MERGE_TAG = TAG + "merge"
INVALID = object()  # a scalar we refuse to construct (unknown tag or bad explicit tag)

# A float as YAML 1.2 writes it. PyYAML implements YAML 1.1, whose floats need a '.' and a
# signed exponent, so `1.0e9` and `1e9` load as strings; for an integer or number setting
# they are read (or at least described) as the floats the user meant.
_YAML12_FLOAT_RE = re.compile(r"[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?")

# PyYAML's own rule (yaml.reader.Reader.NON_PRINTABLE), checked up front so that the message
# and line are the same whichever parser runs.
_NON_PRINTABLE_RE = re.compile(
    "[^\x09\x0a\x0d\x20-\x7e\x85\xa0-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]"
)

#: Mapping keys with this prefix are ignored where a block allows extensions, so they can
#: hold anchors for `<<` merges (the Docker Compose convention).
EXTENSION_PREFIX = "x-"


class Field(NamedTuple):
    """A value node (None when the key is absent) and the key path used to report it."""

    node: Optional[Node]
    key: str


_PLAIN_KEY_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*|<<")


@dataclass
class Block:
    """A mapping whose keys were checked; gives each entry its key path."""

    node: MappingNode
    path: str
    entries: dict[str, tuple[Node, Node]]  # key text -> (key node, value node)
    bracket_keys: bool = False  # env["A B"] rather than env.A B: env names can be anything

    def has(self, name: str) -> bool:
        return name in self.entries

    def key(self, name: str) -> str:
        """The key path of an entry; a name that is not a plain word is shown quoted, so a
        key holding a newline or a dot cannot break or fake the path."""
        if self.bracket_keys or not _PLAIN_KEY_RE.fullmatch(name):
            return f"{self.path}[{json.dumps(clip(name, SHOWN_MAX), ensure_ascii=False)}]"
        name = clip(name, SHOWN_MAX)
        return f"{self.path}.{name}" if self.path else name

    def field(self, name: str) -> Field:
        entry = self.entries.get(name)
        return Field(entry[1] if entry else None, self.key(name))


def line_of(node: Node) -> int:
    return int(node.start_mark.line) + 1


def is_plain(node: ScalarNode) -> bool:
    return not node.style  # None from PyYAML's parser, '' from libyaml's


def looks_like_float(node: Node) -> bool:
    """A plain string scalar that YAML 1.2 (and the user) would call a float."""
    return (
        isinstance(node, ScalarNode)
        and node.tag == TAG + "str"
        and is_plain(node)
        and len(node.value) <= NUMBER_MAX_CHARS
        and _YAML12_FLOAT_RE.fullmatch(node.value) is not None
    )


def describe(node: Node) -> str:
    """Name a node the way the user wrote it ("string 'two'", "boolean yes"), in YAML terms."""
    kind = KIND_BY_TAG.get(node.tag)
    if kind is None:
        return f"a value tagged {shown(node.tag)}"
    if not isinstance(node, ScalarNode) or kind == "null":
        return kind
    if looks_like_float(node):
        return f"float {node.value}"
    if kind == "string":
        return f"string {shown(node.value)}"
    if len(node.value) > SHOWN_MAX:
        return f"{kind} {node.value[:SHOWN_MAX]}... ({len(node.value)} characters)"
    return f"{kind} {node.value}"


class _TooDeep(Exception):
    """Collections nested deeper than DEPTH_MAX, raised while composing."""

    def __init__(self, key: str, line: int) -> None:
        super().__init__(key, line)
        self.key = key
        self.line = line


class _BoundedComposer(Composer):
    """PyYAML's composer, refusing to nest deeper than ``DEPTH_MAX`` collections.

    The composer recurses once per level (a few Python frames each), so a 5000-deep ``[[[``
    file would end in RecursionError; here it stops at the first level too many, and knows
    the key path to report. Nodes keep only their start mark (all we report), which saves a
    third of the memory of a large file.
    """

    peek_event: Callable[[], Event]  # provided by the parser half of the loader

    def __init__(self) -> None:
        Composer.__init__(self)
        self._path: list[str] = []
        self._collections = 0

    def compose_node(self, parent: Optional[Node], index: Any) -> Optional[Node]:
        self._path.append(_path_part(parent, index))
        try:
            opens = isinstance(self.peek_event(), (SequenceStartEvent, MappingStartEvent))
            if opens:
                if self._collections >= DEPTH_MAX:
                    mark = self.peek_event().start_mark
                    line = 0 if mark is None else int(mark.line) + 1
                    raise _TooDeep("".join(self._path).lstrip("."), line)
                self._collections += 1
            try:
                node = super().compose_node(parent, index)
            finally:
                if opens:
                    self._collections -= 1
        finally:
            self._path.pop()
        if node is not None:
            node.end_mark = node.start_mark
        return node


def _path_part(parent: Optional[Node], index: object) -> str:
    """The key-path piece of a node being composed, as Problem keys write it."""
    if parent is None:
        return ""
    if isinstance(index, int):
        return f"[{index}]"
    if isinstance(index, ScalarNode):
        return f".{clip(str(index.value), SHOWN_MAX)}"
    return ".?"  # a mapping key, or a value under a non-scalar key


class _PyLoader(Reader, Scanner, Parser, _BoundedComposer, Resolver):
    """Pure-Python parsing; used when PyYAML was built without libyaml."""

    def __init__(self, stream: str) -> None:
        Reader.__init__(self, stream)
        Scanner.__init__(self)
        Parser.__init__(self)
        _BoundedComposer.__init__(self)
        Resolver.__init__(self)


def _make_loader() -> Callable[[str], _BoundedComposer]:
    """libyaml's parser under our composer when available: about 6x faster on a 1 MiB file,
    with the same nodes, marks and tag resolution (the composer and resolver are Python)."""
    try:
        from yaml._yaml import CParser
    except ImportError:  # PyYAML without libyaml
        return _PyLoader

    class _CLoader(_BoundedComposer, CParser, Resolver):  # type: ignore[misc]
        def __init__(self, stream: str) -> None:
            CParser.__init__(self, stream)
            _BoundedComposer.__init__(self)
            Resolver.__init__(self)

    return _CLoader


_Loader = _make_loader()


def compose(text: str, file: str) -> tuple[Optional[Node], Optional[Problem]]:
    """Parse without constructing anything: the root node, or the located problem that
    stopped it (too big, not Unicode, a forbidden character, too deep, bad syntax, empty)."""
    problem = _text_problem(text, file)
    if problem is not None:
        return None, problem
    try:
        root = _Loader(text).get_single_node()
    except _TooDeep as exc:
        message = f"nested more than {DEPTH_MAX} levels deep (lists and mappings)"
        return None, make_problem(file, exc.key, exc.line, message)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        # PyYAML splits its sentences: "while scanning a simple key" + "could not find..."
        reason = ", ".join(part for part in (exc.context, exc.problem) if part)
        where = None if mark is None else int(mark.line) + 1
        return None, make_problem(file, "", where, f"invalid YAML: {reason}")
    except ReaderError as exc:  # not expected after the check above; kept as a net
        reason = str(exc).splitlines()[0]  # the rest names "<unicode string>", not the file
        return None, make_problem(file, "", None, f"invalid YAML: {reason}")
    if root is None:
        message = "file is empty (expected a mapping with 'workers')"
        return None, make_problem(file, "", None, message)
    return root, None


def _text_problem(text: str, file: str) -> Optional[Problem]:
    """What is wrong with the text before it is parsed: its size, a lone surrogate, a
    character YAML refuses."""
    if len(text) > FILE_MAX_BYTES:  # characters: a cheap first test, bytes come next
        return make_problem(file, "", None, file_too_big(len(text), at_least=True))
    try:
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError as exc:
        line = text.count("\n", 0, exc.start) + 1
        message = f"not valid Unicode (a lone surrogate U+{ord(text[exc.start]):04X})"
        return make_problem(file, "", line, message)
    if size > FILE_MAX_BYTES:
        return make_problem(file, "", None, file_too_big(size))
    bad = _NON_PRINTABLE_RE.search(text)
    if bad:
        line = text.count("\n", 0, bad.start()) + 1
        message = (
            f"invalid YAML: unacceptable character #x{ord(bad.group()):04x}: "
            "special characters are not allowed"
        )
        return make_problem(file, "", line, message)
    return None
