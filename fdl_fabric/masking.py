"""The one rule that decides which values are secrets, and hides them wherever a run's
facts are shown or kept: ``--dry-run``, ``cluster.json``, events (``--json``,
events.jsonl), a run's record and ``status``.

A value is a secret when

* **its name says so** (`SECRET_NAME_RE`: ``API_SECRET``, ``HF_TOKEN``, ``DB_PASSWORD``,
  ``WANDB_API_KEY``...; the launcher's own ``FLODL_INTERNAL_*`` ids excepted), or the
  cluster file's ``secret_env: [NAME, "GLOB_*"]`` names it (`declare`): the whole value
  reads ``***``;
* **its text says so**, wherever it appears, in an environment or in any other string:

  - a URL with credentials, ``scheme://user:password@host/...``: only the password
    reads ``***`` (``postgres://u:***@h/db``), so the URL stays readable;
  - a token with a well-known prefix: GitHub (``ghp_``, ``gho_``, ``ghu_``, ``ghs_``,
    ``ghr_``, ``github_pat_``), Hugging Face (``hf_``), OpenAI and Anthropic
    (``sk-``), Stripe (``sk_live_``, ``sk_test_``, ``rk_live_``), Slack (``xoxb-``,
    ``xoxp-``, ``xoxa-``, ``xoxr-``, ``xoxs-``, ``xapp-``), GitLab (``glpat-``), npm
    (``npm_``), PyPI (``pypi-``), Google (``AIza``), AWS key ids (``AKIA``, ``ASIA`` and
    16 capitals or digits), and JSON web tokens (``eyJ…``, three dotted parts);
  - a token-shaped word (`token_shaped`): over 20 characters of letters, digits and
    ``+ / _ -``, which looks random rather than written;
  - a declared value (`declare`: a ``secret_env`` variable's) of at least
    `DECLARED_VALUE_MIN` characters, wherever it appears (a command line that repeats
    it, an error that quotes it).

What is *not* a secret by its text, on purpose (false positives cost a readable plan;
each of these is still hidden by its name or by ``secret_env``):

* hex digits and dashes only: git SHAs, sha256 digests, UUIDs, run ids, cluster keys.
  A training run names commits and checkpoints by them all the time; a hex secret
  (a W&B key) is caught by its name;
* paths, host names, URLs without a password, numbers, variable names
  (``NCCL_SOCKET_IFNAME``), model ids (``meta-llama/Llama-2-7b-chat-hf``), run names
  made of hyperparameters (``lr3e-4_bs32_seed42``): separators, words and long runs of
  one kind of character are what written text has and random text has not;
* a token without a known prefix made of a single kind of character, or of lowercase
  letters and digits in long runs: indistinguishable from a word; and ``user:pw@host``
  without a ``scheme://``, which is also how ``git@host:repo`` reads.

The rule is pure, but a process learns names and values from the cluster file
(`declare`: when the file is read, then the launcher's forwarded values when a plan
takes them) and keeps them until it ends, like a CI runner's ``add-mask``: a sink
that never sees the plan (an event's words, a record, ``status``) still hides them,
and nothing can un-declare one. The ranks get the real values: the agent's spec
(`planning.plan.LaunchPlan.agent_spec`) carries them on its stdin; whatever shows or
keeps facts goes through `mask_text`, `mask_env` or `mask_data`. Rank output is the
ranks' own, shown and kept as they print it.

Vocabulary layer: the standard library only.
"""

from __future__ import annotations

import fnmatch
import functools
import math
import re
import threading
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

#: What a secret reads as, in every sink.
MASK = "***"

#: Env names whose values are secrets, whatever they look like.
SECRET_NAME_RE = re.compile(r"SECRET|TOKEN|PASSW|KEY|CREDENTIAL|AUTH|COOKIE|PRIVATE", re.I)
#: The launcher's own variables: ids and addresses, never a secret by name
#: (``FLODL_INTERNAL_CLUSTER_KEY`` is a hash of the file's path).
_OWN_PREFIX = "FLODL_INTERNAL_"

#: A declared value shorter than this (blanks aside) is hidden only under its name:
#: hiding every ``abc`` of every line would garble the plan and still tell the
#: secret's length.
DECLARED_VALUE_MIN = 6
#: A token-shaped word is longer than this ("high-entropy strings over 20 characters").
TOKEN_MIN = 21

_TAIL = r"[A-Za-z0-9_\-]{16,}"
_PREFIXED_RE = re.compile(
    r"(?<![A-Za-z0-9])(?:gh[pousr]_|github_pat_|hf_|sk-|[sr]k_(?:live|test)_|"
    r"xox[abprs]-|xapp-|glpat-|npm_|pypi-|AIza)(?P<tail>" + _TAIL + ")")
_AWS_ID_RE = re.compile(r"(?<![A-Za-z0-9])(?:AKIA|ASIA)[A-Z0-9]{16}(?![A-Za-z0-9])")
_JWT_RE = re.compile(r"(?<![A-Za-z0-9_\-])eyJ[A-Za-z0-9_\-]{4,}\.eyJ[A-Za-z0-9_\-]{4,}"
                     r"\.[A-Za-z0-9_\-]*")
#: Words a token-shaped check looks at: the token alphabet, ``=`` only as padding.
_WORD_RE = re.compile(r"[A-Za-z0-9+/_\-]{" + str(TOKEN_MIN) + r",}={0,2}")
#: Hex digits joined by ``-`` or ``+``: UUIDs, digests, a dirty tree's code id
#: (``git:1a2b3c4d5e6f+0a1b2c3d``): no secret looks like that.
_HEXISH_RE = re.compile(r"[0-9a-fA-F+\-]+")
_SEPARATORS = frozenset("+/_-=")
#: Pieces a written word splits into: ``Auto`` ``Model`` ``LM`` ``2204``.
_PIECE_RE = re.compile(r"[A-Z]?[a-z]+|[A-Z]+(?![a-z])|[0-9]+")
#: At most this many characters between changes of kind, on average: random text
#: changes often, words do not.
_PIECE_MEAN_MAX = 3.0
#: Shannon entropy at least this share of the most a word of its length can have.
_ENTROPY_SHARE = 0.75
#: Where a URL's authority ends (``'`` is a character a password may hold).
_AUTHORITY_END_RE = re.compile(r"[\s/?#\"<>\\]")
_SCHEME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789+.-")


class _Declared:
    """The names and values this process was told are secret (`declare`). Replaced
    whole under a lock, read without one: a reader sees the old set or the new one."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.names: frozenset[str] = frozenset()
        self.values: tuple[str, ...] = ()
        #: A new object at each `add`: what a `Masked` was masked under.
        self.state: object = object()

    def add(self, names: Iterable[str], values: Iterable[str]) -> None:
        with self._lock:
            self.names = self.names | frozenset(names)
            longer = {v for v in values if len(v.strip()) >= DECLARED_VALUE_MIN}
            # Longest first, so a value that contains another is hidden whole.
            self.values = tuple(sorted(set(self.values) | longer, key=lambda v: (-len(v), v)))
            self.state = object()


_DECLARED = _Declared()


def declare(names: Iterable[str] = (), values: Iterable[str] = ()) -> None:
    """Tell this process that variables ``names`` (names or globs: ``secret_env``) are
    secrets, and that ``values`` are secret wherever they appear. For good: a secret
    once shown can not be taken back, so nothing un-declares one."""
    _DECLARED.add(names, values)


def secret_name(name: str) -> bool:
    """Whether the variable ``name`` holds a secret by its name: `SECRET_NAME_RE`, or
    named by a ``secret_env`` (`declare`)."""
    return _secret_name(name, _DECLARED.names)


#: Strings whose verdict is remembered (`_secret_name`, `_masked`): a launch of 8,192
#: ranks masks the same few hundred names and values tens of thousands of times.
MASK_CACHE = 4096
#: Longer texts are remembered in a smaller table of their own (`_masked_long`), so
#: the short names and values of a plan are never pushed out by them.
MASK_CACHE_TEXT_MAX = 256
#: Texts up to this long are remembered there: a rank's command line repeats for every
#: rank of a plan (an emulated ``python -c`` of 290 characters, masked afresh for 8,192
#: ranks, was a sixth of the launch's main thread; issue 35). Longer ones, error
#: messages and output tails, are masked afresh. At most `MASK_CACHE_LONG` x this held.
MASK_CACHE_LONG_TEXT_MAX = 16384
MASK_CACHE_LONG = 256


@functools.lru_cache(maxsize=MASK_CACHE)
def _secret_name(name: str, patterns: frozenset[str]) -> bool:
    if SECRET_NAME_RE.search(name) and not name.startswith(_OWN_PREFIX):
        return True
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)


def mask_env(env: Mapping[str, str]) -> dict[str, str]:
    """An environment as it may be shown: a secret name's value ``***`` (the name stays
    visible), every other value through `mask_text`.

    Each (name, value) pair's verdict is remembered while nothing more is declared
    secret: 8,192 ranks' environments differ in a few variables each, and the plan's
    ``cluster.json`` and the launch's events showed every one of their ~20 pairs
    through two cached calls, a fifth of a second of the launch's CPU (issue 35)."""
    shown = _PAIRS.under(_DECLARED.state)
    out: dict[str, str] = {}
    for k, v in env.items():
        try:
            out[k] = shown[k, v]
            continue
        except KeyError:
            pass
        except TypeError:  # a value that cannot be a key: masked, never remembered
            out[k] = _env_value(k, v)
            continue
        out[k] = value = _env_value(k, v)
        if len(shown) < MASK_CACHE * 4 and (type(v) is not str or len(v) <= MASK_CACHE_TEXT_MAX):
            shown[k, v] = value
    return out


def _env_value(name: str, value: Any) -> Any:
    """A secret name's value ``***`` (whatever its type); else a string through
    `mask_text`, and anything else walked by `_mask_data` (an ``env`` that holds a
    list or a mapping: every string in it masked)."""
    if secret_name(name):
        return MASK
    return mask_text(value) if isinstance(value, str) else _mask_data(value)


class _Pairs:
    """`mask_env`'s remembered pairs, for one `_Declared.state`: a new declaration
    starts an empty table (a pair shown before may be a secret now)."""

    def __init__(self) -> None:
        self._table: tuple[object, dict[tuple[str, Any], Any]] = (None, {})

    def under(self, state: object) -> dict[tuple[str, Any], Any]:
        # The state and its table are one object, swapped whole: a thread that read an
        # older state fills a table of that state, which no later reader takes.
        table = self._table
        if table[0] is not state:
            table = self._table = (state, {})
        return table[1]


_PAIRS = _Pairs()


def mask_text(text: str) -> str:
    """``text`` with every secret its text reveals hidden (see the module's rule): a
    URL's password, prefixed tokens, JSON web tokens, token-shaped words, declared
    values."""
    if not text:
        return text
    size = len(text)
    if size <= MASK_CACHE_TEXT_MAX:
        return _masked(text, _DECLARED.values)
    if size <= MASK_CACHE_LONG_TEXT_MAX:
        return _masked_long(text, _DECLARED.values)
    return _mask(text, _DECLARED.values)


@functools.lru_cache(maxsize=MASK_CACHE)
def _masked(text: str, values: tuple[str, ...]) -> str:
    return _mask(text, values)


@functools.lru_cache(maxsize=MASK_CACHE_LONG)
def _masked_long(text: str, values: tuple[str, ...]) -> str:
    return _mask(text, values)


def _mask(text: str, values: tuple[str, ...]) -> str:
    """Each pattern is tried only where it could match: its literal part is in the text
    and the text is long enough (a C substring check). Most strings of an event, a host
    or a rank's label, need none of the five passes; at 8,192 ranks, the labels missed
    every cache and the passes were a tenth of the record's writer (issue 35)."""
    text = _without_declared(text, values)
    if "eyJ" in text:
        text = _JWT_RE.sub(MASK, text)
    size = len(text)
    if size >= _PREFIXED_MIN:
        text = _PREFIXED_RE.sub(_prefixed, text)
    if "AKIA" in text or "ASIA" in text:
        text = _AWS_ID_RE.sub(MASK, text)
    if "://" in text:
        text = _url_passwords(text)
    if len(text) >= TOKEN_MIN:
        text = _WORD_RE.sub(_word, text)
    return text


#: The shortest text `_PREFIXED_RE` can match: the shortest prefix and its tail.
_PREFIXED_MIN = len("hf_") + 16


def _without_declared(text: str, values: tuple[str, ...]) -> str:
    """``text`` with every declared value replaced, again until none is left: a
    replacement can bring the pieces of another occurrence together (``ab***`` ...).
    Each one shortens the text (a value is longer than `MASK`), so this ends."""
    found = True
    while found:
        found = False
        for value in values:
            if value in text:
                text = text.replace(value, MASK)
                found = True
    return text


class Masked(dict):  # type: ignore[type-arg]
    """A mapping as `mask_data` returned it. A second `mask_data` keeps it as it is
    while nothing more was declared secret (`declare`) since. Why: an event's data is
    masked where the run's record takes it, then again by its record's words and its
    JSON line; at 8,192 ranks the repeats were a third of a rank's record, and a rank's
    label missed the mask cache between them. Never changed in place (an event's data
    is not): what adds to one builds a plain ``dict(...)``, which is masked afresh."""

    __slots__ = ("under",)

    def __init__(self, data: dict[Any, Any], under: object) -> None:
        super().__init__(data)
        #: What was declared secret when it was masked (`_Declared.state`).
        self.under = under


def mask_data(data: Any) -> Any:
    """A copy of JSON-like ``data`` as it may be shown or kept: every mapping under a key
    ``env`` (or ending in ``_env``) through `mask_env`, every other string through
    `mask_text`. Keys are kept as they are: they are the data's own names. A mapping
    comes back `Masked`, which is not masked twice."""
    state = _DECLARED.state
    if type(data) is Masked and data.under is state:
        return data
    shown = _mask_data(data)
    return Masked(shown, state) if type(shown) is dict else shown


def _mask_data(data: Any) -> Any:
    kind = type(data)  # the common types first, by identity: every record walks here
    if kind in _ATOMS:
        return data
    if kind is dict:
        return {k: mask_env(v) if _is_env_key(k) and isinstance(v, Mapping)
                else _mask_data(v) for k, v in data.items()}
    if kind is list:  # a rank's argv, a gateway's leaves: plain strings, one call each
        return [mask_text(item) if type(item) is str else _mask_data(item) for item in data]
    if isinstance(data, str):
        shown = mask_text(data)
        return data if shown == data else shown  # the same object (an enum's) when clean
    if isinstance(data, Mapping):
        return {k: mask_env(v) if _is_env_key(k) and isinstance(v, Mapping)
                else _mask_data(v) for k, v in data.items()}
    if isinstance(data, tuple):
        return tuple(_mask_data(item) for item in data)
    if isinstance(data, list):
        return [_mask_data(item) for item in data]
    return data


#: Values with no string inside: kept as they are.
_ATOMS = frozenset({int, float, bool, type(None)})


def _is_env_key(key: Any) -> bool:
    return isinstance(key, str) and (key == "env" or key.endswith("_env"))


def token_shaped(word: str) -> bool:
    """Whether ``word`` looks like a random token rather than something written: over
    20 characters (`TOKEN_MIN`) of letters, digits and ``+ / _ -``; not hex digits and
    dashes only; at most one separator in ten characters; at least two of lowercase,
    uppercase and digits, changing kind every `_PIECE_MEAN_MAX` characters or sooner on
    average; and a Shannon entropy of at least `_ENTROPY_SHARE` of the most its length
    allows. A word with ``/`` is a path: each of its parts is judged alone (so a base64
    secret whose ``/``-separated parts are all short is missed: it is caught by its
    variable's name). A git SHA, a path, ``AutoModelForCausalLM``,
    ``lr3e-4_bs32_seed42`` or a mangled C++ name is not; ``Zk4Qp9sLx2Vb7Nw3Rt6Yh1Jm`` is."""
    if len(word) < TOKEN_MIN or _HEXISH_RE.fullmatch(word) or word.startswith("_Z"):
        return False  # ``_Z``: a mangled C++ name (``_ZN3c1010TensorImplD2Ev``) in a stack
    core = word.rstrip("=")
    if "/" in core:  # a path's folders are judged one by one (``.fdl-code/trees/<hex>``)
        return any(token_shaped(part) for part in core.split("/"))
    separators = sum(1 for c in core if c in _SEPARATORS)
    if separators * 10 > len(core):
        return False
    letters = "".join(c for c in core if c.isalnum())
    if _kinds(letters) < 2:
        return False
    pieces = _PIECE_RE.findall(letters)
    if not pieces or len(letters) / len(pieces) > _PIECE_MEAN_MAX:
        return False
    return _entropy(letters) >= _ENTROPY_SHARE * math.log2(min(len(letters), 62))


def _kinds(text: str) -> int:
    """How many of lowercase, capitals and digits ``text`` has."""
    return sum(1 for kind in (str.islower, str.isupper, str.isdigit)
               if any(kind(c) for c in text))


def _entropy(text: str) -> float:
    """Shannon entropy of ``text``'s characters, in bits per character."""
    n = len(text)
    return -sum(c / n * math.log2(c / n) for c in Counter(text).values())


def _prefixed(match: re.Match[str]) -> str:
    """A prefixed token is hidden when its tail looks like one: two kinds of character
    at least, few separators (``hf_hub_enable_hf_transfer`` and
    ``sk-learn-intelex-2024-07`` are words)."""
    tail = match.group("tail")
    separators = sum(1 for c in tail if c in "_-")
    return MASK if _kinds(tail) >= 2 and separators * 10 <= len(tail) else match.group(0)


#: What precedes a public fingerprint (an SSH host key's ``SHA256:...``, as ssh and the
#: connection errors print it): random-looking by nature, and no secret.
_FINGERPRINT_PREFIXES = ("SHA256:", "SHA384:", "SHA512:")


def _word(match: re.Match[str]) -> str:
    before = match.string[max(0, match.start() - 7):match.start()]
    if before in _FINGERPRINT_PREFIXES:
        return match.group(0)
    return MASK if token_shaped(match.group(0)) else match.group(0)


def _url_passwords(text: str) -> str:
    """Every ``scheme://user:password@`` with its password hidden. Found by
    ``://`` and scanned by hand, in one pass: a pattern that tried a scheme at every
    position of a long word would take quadratic time."""
    out: list[str] = []
    done = 0
    start = text.find("://")
    while start != -1:
        if start > 0 and text[start - 1] in _SCHEME_CHARS:
            authority_start = start + 3
            end_match = _AUTHORITY_END_RE.search(text, authority_start)
            end = len(text) if end_match is None else end_match.start()
            at = text.rfind("@", authority_start, end)
            colon = text.find(":", authority_start, at) if at != -1 else -1
            if colon != -1 and at > colon + 1 and text[colon + 1:at] != MASK:
                out.append(text[done:colon + 1])
                out.append(MASK)
                done = at
        start = text.find("://", start + 3)
    out.append(text[done:])
    return "".join(out)


__all__ = ["DECLARED_VALUE_MIN", "MASK", "SECRET_NAME_RE", "TOKEN_MIN", "Masked", "declare",
           "mask_data", "mask_env", "mask_text", "secret_name", "token_shaped"]
