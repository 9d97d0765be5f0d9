"""What starts an agent on a host: a short command line, then its source on stdin.

Nothing is installed on hosts. The command line is a few hundred bytes of Python that
reads a length-prefixed loader from its stdin and runs it; the loader reads the bundle
that follows: the agent's modules (`fdl_fabric.agent` and `fdl_fabric.rank`, standard
library only) as sources, and as code compiled here for a host on the same Python
version, and serves them to ``import`` from memory. So the command line never grows with the run
(no ``E2BIG`` whatever the argv), carries no secret, and the agent's frames follow on
the same stdin.

The remote command prefers ``/usr/bin/python3``: the agent needs only the standard
library, and a ``python3`` found on the login PATH may be a pyenv or conda shim that
costs 100 ms or more per start. ``-I`` keeps ``PYTHON*`` variables and the user's
site-packages out of the agent, ``-S`` skips ``site`` (faster, nothing needed).
"""

from __future__ import annotations

import functools
import hashlib
import marshal
import os
import sys
import zlib
from pathlib import Path

from ..agent.registry import ENV_STATE_DIR
from ..shell import quote
from . import bundlecache

#: Modules shipped to hosts, by import name; packages are marked. Every module of
#: `fdl_fabric.agent` ships (a new one needs no line here), plus the rank client.
_PACKAGES = ("fdl_fabric", "fdl_fabric.agent")


def _agent_modules() -> tuple[str, ...]:
    folder = Path(__file__).resolve().parent.parent / "agent"
    return tuple(f"fdl_fabric.agent.{p.stem}" for p in sorted(folder.glob("*.py"))
                 if p.stem != "__init__")


_MODULES = ("fdl_fabric.rank", *_agent_modules())
#: Digits of the payload's length header.
_HEADER_DIGITS = 10

#: What the bootstrap says when its stdin does not begin with the payload's header:
#: something read it first (a login shell's rc file running ``read`` or ``cat``).
STDIN_TAKEN = "fdl-fabric agent: its stdin was read before it started"

#: The command-line part: check the Python version, read exactly the payload, run it.
#: os.read, not sys.stdin: a buffered reader would swallow the frames that follow.
BOOTSTRAP = (
    "import os,sys\n"
    "if sys.version_info<(3,8):\n"
    " sys.stderr.write('fdl-fabric agent: needs Python 3.8 or newer, found %s\\n'"
    "%sys.version.split()[0]);sys.exit(3)\n"
    "def r(n):\n"
    " b=b''\n"
    " while len(b)<n:\n"
    "  c=os.read(0,n-len(b))\n"
    "  if not c:sys.stderr.write('fdl-fabric agent: payload cut short\\n');sys.exit(3)\n"
    "  b+=c\n"
    " return b\n"
    f"h=r({_HEADER_DIGITS})\n"
    f"if not h.isdigit():sys.stderr.write('{STDIN_TAKEN}\\n');sys.exit(3)\n"
    "exec(compile(r(int(h)),'<fdl-agent>','exec'))\n"
)

_LOADER = '''\
import marshal, sys, zlib
from importlib.machinery import ModuleSpec
BUNDLE = marshal.loads(zlib.decompress(r(int(r({digits})))))
SOURCES = BUNDLE["src"]
PACKAGES = set(BUNDLE["packages"])
# Code compiled by the launcher, used when this Python reads it as its own (same cache
# tag): compiling the agent's sources costs every host ~12 ms of CPU per start.
CODE = BUNDLE["code"] if BUNDLE["tag"] == sys.implementation.cache_tag else {{}}
class _Finder:
    # A meta path finder and loader by protocol (importlib.abc costs 12 ms of imports).
    def find_spec(self, name, path=None, target=None):
        if name in SOURCES:
            return ModuleSpec(name, self, is_package=name in PACKAGES)
        return None
    def create_module(self, spec):
        return None
    def exec_module(self, module):
        name = module.__name__
        code = None
        if name in CODE:
            try:
                code = marshal.loads(CODE[name])
            except (ValueError, EOFError, TypeError):
                code = None
        if code is None:
            path = "fdl-agent/" + name.replace(".", "/") + (
                "/__init__.py" if name in PACKAGES else ".py")
            code = compile(SOURCES[name], path, "exec")
        exec(code, module.__dict__)
sys.meta_path.insert(0, _Finder())
if sys.argv[1:2] == ["relay"]:
    from fdl_fabric.agent.relay import main
else:
    from fdl_fabric.agent.main import main
sys.exit(main())
'''


def _source_of(name: str) -> str:
    root = Path(__file__).resolve().parent.parent.parent
    rel = Path(*name.split("."))
    path = root / rel / "__init__.py" if name in _PACKAGES else root / rel.with_suffix(".py")
    if name == "fdl_fabric":
        return '"""fdl-fabric, as shipped to a host: the agent and the rank client only."""\n'
    return path.read_text(encoding="utf-8")


@functools.lru_cache(maxsize=2)
def payload(tag: str = sys.implementation.cache_tag) -> bytes:
    """What follows the bootstrap on stdin (built once, and kept by content in this
    user's cache, `bundlecache`): the loader's source, then the bundle it reads itself,
    each behind a length header. The bundle is a marshalled dict of plain values
    (readable by any Python 3), zlib-compressed: every module's source, and the same
    modules compiled by this Python, which the host uses only if it is the same
    version."""
    sources = {name: _source_of(name) for name in (*_PACKAGES, *_MODULES)}
    key = hashlib.sha256(repr((sys.version, tag, _LOADER, _HEADER_DIGITS,
                               sorted(sources.items()))).encode()).hexdigest()[:40]
    return bundlecache.cached(key, lambda: _build(sources, tag))


def _build(sources: dict[str, str], tag: str) -> bytes:
    compiled = {name: marshal.dumps(compile(src, "fdl-agent/" + name.replace(".", "/") + (
        "/__init__.py" if name in _PACKAGES else ".py"), "exec"))
        for name, src in sources.items()}
    # Compressed: every agent start carries it (through a gateway's stream too), and
    # sources with their compiled code shrink about 3x; the host inflates it in ms. Level
    # 6, not 9: 9 took 144 ms of every launch for 1 % fewer bytes (33 ms at 6).
    bundle = zlib.compress(marshal.dumps({"src": sources, "packages": list(_PACKAGES),
                                          "tag": tag, "code": compiled}, 4), 6)
    loader = _LOADER.format(digits=_HEADER_DIGITS).encode()
    return (f"{len(loader):0{_HEADER_DIGITS}d}".encode() + loader
            + f"{len(bundle):0{_HEADER_DIGITS}d}".encode() + bundle)


#: What the bundle runs: a host's agent, or a gateway's relay (`agent.relay`).
MODES = ("agent", "relay")


def remote_command(mode: str = "agent") -> str:
    """The command an SSH session runs: the host's python3 with the bootstrap, and the
    launcher's registry folder override (`agent.registry`), if it has one. ``mode``
    ``relay`` runs a gateway's relay instead of an agent (the bootstrap's one argument,
    which the loader reads)."""
    if mode not in MODES:
        raise ValueError(f"unknown bundle mode {mode!r}")
    boot = quote(BOOTSTRAP)
    state = os.environ.get(ENV_STATE_DIR, "")
    keep = f"export {ENV_STATE_DIR}={quote(state)}; " if state else ""
    arg = " relay" if mode == "relay" else ""
    return f'p=/usr/bin/python3; [ -x "$p" ] || p=python3; {keep}exec "$p" -I -S -c {boot}{arg}'


def local_command(python: str) -> str:
    """The command a local agent runs (through invoke's shell): ``python`` with the bootstrap."""
    return f"exec {quote(python)} -I -S -c {quote(BOOTSTRAP)}"


def source_paths() -> list[str]:
    """Files the bundle is made of (for tests that check they stay standalone)."""
    root = Path(__file__).resolve().parent.parent.parent
    out = []
    for name in (*_PACKAGES[1:], *_MODULES):
        rel = Path(*name.split("."))
        path = root / rel / "__init__.py" if name in _PACKAGES else root / rel.with_suffix(".py")
        out.append(os.fspath(path))
    return out
