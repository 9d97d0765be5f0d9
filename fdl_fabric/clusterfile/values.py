"""Readers shared by the cluster file's blocks: a value or its default, ``env`` and
``env_forward`` (the cluster's and each worker's), so `schema` and `workers` read them
alike.
"""

from __future__ import annotations

import json
import re
from typing import Optional, TypeVar

from yaml.nodes import Node, ScalarNode

from ..limits import (
    ARG_STRLEN_MAX,
    ENV_MAX_BYTES,
    ENV_NAME_MAX,
    ENV_VARS_MAX,
)
from .model import (
    ENV_NAME_RE,
    is_reserved_env_key,
)
from .names import (
    SHOWN_MAX,
    shown,
    unicode_problem,
)
from .yamlread import TAG, Field, NodeReader, describe

_T = TypeVar("_T")


def _or(value: Optional[_T], default: _T) -> _T:
    """Absent and invalid both read as None; invalid ones are already recorded as problems
    (so the spec is discarded), which makes falling back to the default safe in both cases."""
    return default if value is None else value



_FORWARD_RE = re.compile(r"[A-Za-z_*?\[][A-Za-z0-9_*?\[\]!]*")


def _read_env_forward(r: NodeReader, field: Field) -> tuple[str, ...]:
    """Launcher variables to carry to the ranks: names or globs, never reserved names."""
    return _read_names(r, field, "a list of variable names or globs, e.g. [HF_TOKEN, "
                       "'WANDB_*']", forwarded=True)


def read_secret_env(r: NodeReader, field: Field) -> tuple[str, ...]:
    """``secret_env``: variables whose values are secrets whatever they look like
    (`masking`): names or globs. A reserved name is allowed (it hides nothing of
    ours, and refusing it would only make a careful file fail)."""
    return _read_names(r, field, "a list of variable names or globs, e.g. [DATABASE_URL, "
                       "'DB_*']", forwarded=False)


def _read_names(r: NodeReader, field: Field, expected: str, *,
                forwarded: bool) -> tuple[str, ...]:
    """A list of variable names or globs of them (``env_forward``, ``secret_env``);
    ``forwarded``: a reserved name is refused, the launcher sets it for each rank."""
    items = r.sequence(field, expected=expected)
    if items is None:
        return ()
    if len(items) > ENV_VARS_MAX:
        r.problem(field, f"lists {len(items)} names; at most {ENV_VARS_MAX} are allowed")
        return ()
    names: list[str] = []
    for i, item in enumerate(items):
        item_field = Field(item, f"{field.key}[{i}]")
        name = r.string(item_field)
        if name is None:
            continue
        if len(name) > ENV_NAME_MAX or not _FORWARD_RE.fullmatch(name):
            r.problem(item_field, "expected a variable name or a glob of one "
                      f"([A-Za-z_][A-Za-z0-9_]*, with * ? [...]), got {shown(name)}")
            continue
        if forwarded and not any(c in name for c in "*?[") and is_reserved_env_key(name):
            r.problem(item_field, f"{name} is set by the launcher for each rank; it cannot be "
                      "forwarded")
            continue
        names.append(name)
    return tuple(names)



def read_env(r: NodeReader, field: Field) -> dict[str, str]:
    """Environment variables, checked so that every entry can really be exported."""
    block = r.mapping(field, bracket_keys=True, max_entries=ENV_VARS_MAX)
    if block is None:
        return {}
    env: dict[str, str] = {}
    for name, (key_node, value_node) in block.entries.items():
        entry = block.key(name)
        if not ENV_NAME_RE.fullmatch(name):
            r.problem(
                Field(key_node, entry),
                "not a valid environment variable name ([A-Za-z_][A-Za-z0-9_]*)",
            )
            continue
        if len(name) > ENV_NAME_MAX:
            message = f"name is {len(name)} characters long; at most {ENV_NAME_MAX}"
            r.problem(Field(key_node, entry), message)
            continue
        if is_reserved_env_key(name):
            r.problem(
                Field(key_node, entry),
                "is reserved (set by the launcher for each rank); "
                "GPU pinning belongs in local_devices",
            )
            continue
        value_field = Field(value_node, entry)
        value = r.scalar(value_node)
        if not isinstance(value, str):
            r.problem(value_field, _env_type_message(value_node))
            continue
        size = len(name) + 1 + r.utf8_size(value)
        if size > ARG_STRLEN_MAX:
            r.problem(
                value_field,
                f"{name}=value is {size} bytes long; Linux limits one environment string "
                f"to {ARG_STRLEN_MAX} bytes (MAX_ARG_STRLEN)",
            )
            continue
        if r.checked(value_field, value, "env-value", _env_value_problem) is None:
            continue
        env[name] = value
    return env



def _env_value_problem(value: str) -> Optional[str]:
    if "\0" in value:
        return "value contains a NUL character (not allowed in env)"
    return unicode_problem(value)


def _env_type_message(node: Node) -> str:
    """Explain a non-string env value and how to write it, since `N: 8` is an easy slip."""
    message = f"value must be a string, got {describe(node)}"
    if not isinstance(node, ScalarNode):
        return message
    if node.tag == TAG + "null":
        return message + ' (write "" for an empty value)'
    if len(node.value) > SHOWN_MAX:
        return message + " (quote it in YAML)"
    return message + f" (quote it in YAML: {json.dumps(node.value, ensure_ascii=False)})"


def _check_rank_env(
    r: NodeReader, field: Field, cluster_env: dict[str, str], worker_env: dict[str, str]
) -> bool:
    """What one rank gets from the file (the cluster env, then its worker's) must fit in
    ``ENV_VARS_MAX`` variables and ``ENV_MAX_BYTES``: the plan copies it for every rank, and
    exec refuses an environment that does not fit in ARG_MAX. False when it does not."""
    both = " (the cluster env and this worker's env together)" if worker_env else ""
    merged = {**cluster_env, **worker_env}
    if len(merged) > ENV_VARS_MAX:
        r.problem(
            field,
            f"a rank gets {len(merged)} environment variables from the file{both}; "
            f"at most {ENV_VARS_MAX} are allowed",
        )
        return False
    size = sum(len(name) + 1 + r.utf8_size(value) for name, value in merged.items())
    if size > ENV_MAX_BYTES:
        r.problem(
            field,
            f"a rank gets {size} bytes of NAME=value strings from the file{both}; at most "
            f"{ENV_MAX_BYTES} ({ENV_MAX_BYTES >> 20} MiB, half of Linux's usual ARG_MAX)",
        )
        return False
    return True
