"""Reading YAML nodes while collecting problems: the part of config that knows YAML.

Why walk YAML nodes instead of ``yaml.safe_load``: the loaded dict forgets line numbers and
silently keeps the last of two duplicate keys. Composing the node tree keeps both, and each
scalar is built with PyYAML's safe constructor, so no tag can create objects. Nesting is
capped while composing, before PyYAML's recursion can overflow, and merge keys (``<<``)
are expanded with their size bounded. `NodeReader` records a located problem instead of
raising, so one pass finds every mistake; it knows nothing of the cluster schema
(`schema` does). The node tree itself (composing it, naming its nodes) is
`yamlnodes`'s.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterator
from typing import Callable, Optional

import yaml
from yaml.constructor import SafeConstructor
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from ..limits import DEPTH_MAX, MERGED_ENTRIES_MAX, NUMBER_MAX_CHARS, PROBLEMS_MAX
from .names import SHOWN_MAX, host_name_problem, path_problem, shown, unicode_problem
from .problems import Problem, make_problem
from .yamlnodes import (
    EXTENSION_PREFIX,
    INVALID,
    MERGE_TAG,
    NUMBER_TAGS,
    SCALAR_TAGS,
    TAG,
    Block,
    Field,
    compose,
    describe,
    line_of,
    looks_like_float,
)

__all__ = ["INVALID", "TAG", "Block", "Field", "NodeReader", "Stop", "describe", "line_of"]


class Stop(Exception):
    """PROBLEMS_MAX problems are recorded: stop reading (aliases can repeat one broken
    mapping thousands of times, and nobody reads past the first screens anyway)."""


class NodeReader:
    """Type-checked access to YAML nodes that records problems instead of raising.

    Every reader returns None for an absent *or* invalid value, so callers can carry on and
    find the next problem; ``parse_cluster`` raises once at the end if anything was recorded.
    Aliases make one node reachable from many places, so whatever costs time in proportion
    to a value is memoized per node: checks (``checked``), byte sizes, and merged mappings.
    """

    def __init__(self, file: str) -> None:
        self.file = file
        self.problems: list[Problem] = []
        self.stopped = False
        self._constructor = SafeConstructor()
        self._verdicts: dict[tuple[int, str], Optional[str]] = {}
        self._sizes: dict[int, tuple[str, int]] = {}
        self._flattened: dict[int, dict[str, tuple[Node, Node]]] = {}
        self._flattening: set[int] = set()
        self._merge_budget = MERGED_ENTRIES_MAX

    def add(self, problem: Problem) -> None:
        if len(self.problems) >= PROBLEMS_MAX:
            self.stopped = True
            raise Stop
        self.problems.append(problem)

    def problem(self, field: Field, message: str, at: Optional[Node] = None) -> None:
        """Record a problem at ``at`` (default: the field's own node)."""
        node = at if at is not None else field.node
        line = None if node is None else line_of(node)
        self.add(make_problem(self.file, field.key, line, message))

    def wrong_type(self, field: Field, expected: str, hint: str = "") -> None:
        found = "nothing" if field.node is None else describe(field.node)
        self.problem(field, f"expected {expected}, got {found}{hint}")

    def compose(self, text: str) -> Optional[Node]:
        """Parse without constructing anything; a syntax error becomes a located problem."""
        root, problem = compose(text, self.file)
        if problem is not None:
            self.add(problem)
        return root

    def scalar(self, node: Node) -> object:
        """The Python value of a plain scalar, or ``INVALID`` for anything else.

        Only the standard scalar tags are constructed, which is what keeps loading safe, and
        numbers only up to ``NUMBER_MAX_CHARS`` (YAML 1.1's ``1:2:3`` form is quadratic).
        """
        if not isinstance(node, ScalarNode) or node.tag not in SCALAR_TAGS:
            return INVALID
        if node.tag in NUMBER_TAGS and len(node.value) > NUMBER_MAX_CHARS:
            return INVALID
        try:
            return self._constructor.construct_object(node)
        except (yaml.YAMLError, ValueError, KeyError, OverflowError):  # e.g. "!!int abc"
            return INVALID

    def checked(
        self, field: Field, value: str, kind: str, check: Callable[[str], Optional[str]]
    ) -> Optional[str]:
        """``value`` if ``check`` finds no problem in it, else None with the problem recorded.

        The verdict is memoized per node, because an alias can bring one long value into
        every worker.
        """
        assert field.node is not None
        key = (id(field.node), kind)
        if key not in self._verdicts:
            self._verdicts[key] = check(value)
        problem = self._verdicts[key]
        if problem is None:
            return value
        self.problem(field, problem)
        return None

    def utf8_size(self, value: str) -> int:
        """Bytes of ``value`` in UTF-8, memoized per string object (values are shared by all
        the workers an alias brings them to). The entry keeps ``value`` alive, so its id
        cannot be reused for another string."""
        known = self._sizes.get(id(value))
        if known is not None:
            return known[1]
        size = len(value.encode("utf-8", "surrogatepass"))
        self._sizes[id(value)] = (value, size)
        return size

    # Mappings, with merge keys -------------------------------------------------------------

    def mapping(
        self,
        field: Field,
        what: str = "a mapping",
        bracket_keys: bool = False,
        max_entries: Optional[int] = None,
    ) -> Optional[Block]:
        """Entries of a mapping by key *text*, merges applied; reports duplicate, non-scalar
        and (with ``max_entries``) too many keys.

        Keys are taken as written rather than as YAML 1.1 values, so an env var named ``NO``
        or ``ON`` stays a name instead of becoming the boolean False/True.
        """
        node = field.node
        if node is None:
            return None
        if not isinstance(node, MappingNode) or node.tag != TAG + "map":
            self.wrong_type(field, what)
            return None
        if max_entries is not None and len(node.value) > max_entries + 1:  # +1: a '<<'
            self.problem(field, f"has {len(node.value)} entries; at most {max_entries}")
            return None
        block = Block(node, field.key, {}, bracket_keys)
        entries = self._flatten(node, block)
        if max_entries is not None and len(entries) > max_entries:
            self.problem(field, f"has {len(entries)} entries; at most {max_entries}")
            return None
        block.entries = dict(entries)
        return block

    def _flatten(self, node: MappingNode, block: Block) -> dict[str, tuple[Node, Node]]:
        """The entries of ``node`` with its ``<<`` merges applied, computed once per node.

        As in YAML's merge key type, keys written in the mapping beat merged ones, and an
        earlier mapping in ``<<: [*a, *b]`` beats a later one; merged entries keep the lines
        where they are written. Problems name the key path of the mapping being read.
        """
        known = self._flattened.get(id(node))
        if known is not None:
            return known
        if id(node) in self._flattening:
            self.problem(Field(node, block.key("<<")), "a merge includes itself", node)
            return {}
        if len(self._flattening) >= DEPTH_MAX:
            message = f"merges are nested more than {DEPTH_MAX} levels deep"
            self.problem(Field(node, block.key("<<")), message, node)
            return {}
        self._flattening.add(id(node))
        try:
            entries = self._entries(node, block)
        finally:
            self._flattening.discard(id(node))
        self._flattened[id(node)] = entries
        return entries

    def _entries(self, node: MappingNode, block: Block) -> dict[str, tuple[Node, Node]]:
        written: dict[str, tuple[Node, Node]] = {}
        merge: Optional[tuple[Node, Node]] = None
        for key_node, value_node in node.value:
            if not isinstance(key_node, ScalarNode):
                message = f"keys must be names, got {describe(key_node)}"
                self.problem(Field(node, block.path), message, key_node)
                continue
            if key_node.tag == MERGE_TAG:
                if merge is not None:
                    first_line = line_of(merge[0])
                    message = f"duplicate merge key '<<' (first on line {first_line})"
                    self.problem(Field(key_node, block.key("<<")), message)
                    continue
                merge = (key_node, value_node)
                continue
            name = str(key_node.value)
            if name in written:
                first_line = line_of(written[name][0])
                self.problem(
                    Field(key_node, block.key(name)),
                    f"duplicate key {shown(name)} (first on line {first_line})",
                )
                continue
            written[name] = (key_node, value_node)
        if merge is None:
            return written
        merged: dict[str, tuple[Node, Node]] = {}
        merge_field = Field(merge[1], block.key("<<"))
        for source in self._merge_sources(merge_field):
            for name, entry in self._flatten(source, block).items():
                if not self._spend(merge_field):
                    return {**merged, **written}
                merged.setdefault(name, entry)
        merged.update(written)
        return merged

    def _merge_sources(self, field: Field) -> Iterator[MappingNode]:
        expected = "a mapping or a list of mappings to merge (e.g. <<: *defaults)"
        node = field.node
        if isinstance(node, MappingNode) and node.tag == TAG + "map":
            yield node
            return
        if not isinstance(node, SequenceNode) or node.tag != TAG + "seq":
            self.wrong_type(field, expected)
            return
        for i, item in enumerate(node.value):
            if not isinstance(item, MappingNode) or item.tag != TAG + "map":
                self.wrong_type(Field(item, f"{field.key}[{i}]"), "a mapping to merge")
                continue
            if not self._spend(field):
                return
            yield item

    def _spend(self, field: Field) -> bool:
        """Count one merged entry (or source) against MERGED_ENTRIES_MAX for the file."""
        self._merge_budget -= 1
        if self._merge_budget >= 0:
            return True
        if self._merge_budget == -1:  # report once, at the merge that ran out
            message = f"merge keys copy more than {MERGED_ENTRIES_MAX} entries in this file"
            self.problem(field, message)
        return False

    def block(
        self,
        field: Field,
        allowed: tuple[str, ...],
        what: str = "a mapping",
        extensions: bool = False,
    ) -> Optional[Block]:
        """A mapping with a fixed set of keys; unknown keys are reported with a suggestion.

        With ``extensions``, keys starting with ``x-`` are accepted and ignored.
        """
        block = self.mapping(field, what)
        if block is None:
            return None
        for name, (key_node, _) in list(block.entries.items()):
            if name in allowed:
                continue
            if not (extensions and name.startswith(EXTENSION_PREFIX)):
                message = f"unknown key {shown(name)}"
                close = difflib.get_close_matches(name[:SHOWN_MAX], allowed, n=1)
                if close:
                    message += f" (did you mean {close[0]!r}?)"
                self.problem(Field(key_node, block.key(name)), message)
            del block.entries[name]
        return block

    # Scalars and lists ---------------------------------------------------------------------

    def sequence(self, field: Field, expected: str = "a list") -> Optional[list[Node]]:
        node = field.node
        if node is None:
            return None
        if not isinstance(node, SequenceNode) or node.tag != TAG + "seq":
            self.wrong_type(field, expected)
            return None
        return list(node.value)

    def string(self, field: Field) -> Optional[str]:
        """A non-blank string: every string setting except env values names something."""
        if field.node is None:
            return None
        value = self.scalar(field.node)
        if not isinstance(value, str):
            # `path: ~` is YAML for null, which is almost certainly not what was meant.
            tilde = isinstance(field.node, ScalarNode) and field.node.value == "~"
            self.wrong_type(field, "a string", " (to mean '~', quote it: '~')" if tilde else "")
            return None
        if not value or value.isspace():
            self.problem(field, "must not be empty")
            return None
        return self.checked(field, value, "unicode", unicode_problem)

    def host(self, field: Field) -> Optional[str]:
        """A host name or IP address (see ``host_name_problem``)."""
        value = self.string(field)
        return None if value is None else self.checked(field, value, "host", host_name_problem)

    def path(self, field: Field) -> Optional[str]:
        """A file system path: one line, no NUL, at most PATH_MAX bytes."""
        value = self.string(field)
        return None if value is None else self.checked(field, value, "path", path_problem)

    def boolean(self, field: Field) -> Optional[bool]:
        if field.node is None:
            return None
        value = self.scalar(field.node)
        if not isinstance(value, bool):
            self.wrong_type(field, "a boolean (true or false)")
            return None
        return value

    def _number_too_long(self, field: Field) -> bool:
        node = field.node
        if (
            isinstance(node, ScalarNode)
            and node.tag in NUMBER_TAGS
            and len(node.value) > NUMBER_MAX_CHARS
        ):
            message = (
                f"is a number of {len(node.value)} characters; at most {NUMBER_MAX_CHARS} "
                "are read"
            )
            self.problem(field, message)
            return True
        return False

    def integer(
        self,
        field: Field,
        *,
        minimum: int,
        maximum: Optional[int] = None,
        expected: str = "an integer",
    ) -> Optional[int]:
        if field.node is None or self._number_too_long(field):
            return None
        value = self.scalar(field.node)
        if isinstance(value, bool) or not isinstance(value, int):
            self.wrong_type(field, expected)
            return None
        if maximum is not None and not minimum <= value <= maximum:
            self.problem(field, f"must be between {minimum} and {maximum}, got {value}")
            return None
        if value < minimum:
            self.problem(field, f"must be >= {minimum}, got {value}")
            return None
        return value

    def number(
        self,
        field: Field,
        *,
        minimum: float,
        exclusive: bool = False,
        maximum: Optional[float] = None,
    ) -> Optional[float]:
        """A finite int or float; ``exclusive`` makes ``minimum`` itself invalid."""
        if field.node is None or self._number_too_long(field):
            return None
        value = self.scalar(field.node)
        if looks_like_float(field.node):
            value = float(str(value))  # `1e3` is a string to YAML 1.1, a float to the user
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            self.wrong_type(field, "a number")
            return None
        number = float(value)
        if not math.isfinite(number):
            self.problem(field, f"must be a finite number, got {field.node.value}")
            return None
        if number < minimum or (exclusive and number == minimum):
            bound = f"> {minimum:g}" if exclusive else f">= {minimum:g}"
            self.problem(field, f"must be {bound}, got {field.node.value}")
            return None
        if maximum is not None and number > maximum:
            self.problem(field, f"must be at most {maximum:g}, got {field.node.value}")
            return None
        return number
