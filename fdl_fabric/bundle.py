"""What starts an agent on a host: a short command line, then its source on stdin.

Nothing is installed on hosts. The command line is a few hundred bytes of Python that
reads a length-prefixed payload from its stdin and runs it; the payload carries the
agent's modules (`fdl_fabric.agent` and `fdl_fabric.rank`, standard library only) and
serves them to ``import`` from memory. So the command line never grows with the run
(no ``E2BIG`` whatever the argv), carries no secret, and the agent's frames follow on
the same stdin.

The remote command prefers ``/usr/bin/python3``: the agent needs only the standard
library, and a ``python3`` found on the login PATH may be a pyenv or conda shim that
costs 100 ms or more per start. ``-I`` keeps ``PYTHON*`` variables and the user's
site-packages out of the agent, ``-S`` skips ``site`` (faster, nothing needed).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

from .shell import quote

#: Modules shipped to hosts, by import name; packages are marked.
_PACKAGES = ("fdl_fabric", "fdl_fabric.agent")
_MODULES = ("fdl_fabric.rank", "fdl_fabric.agent.wire", "fdl_fabric.agent.lines",
            "fdl_fabric.agent.procs", "fdl_fabric.agent.children", "fdl_fabric.agent.checks",
            "fdl_fabric.agent.watchdog", "fdl_fabric.agent.main")
#: Digits of the payload's length header.
_HEADER_DIGITS = 10
#: Exit status of the bootstrap itself (old Python, payload cut short).
EXIT_BOOTSTRAP = 3

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
    f"exec(compile(r(int(r({_HEADER_DIGITS}))),'<fdl-agent>','exec'))\n"
)

_LOADER = '''\
import importlib.abc, importlib.util, sys
SOURCES = {sources}
PACKAGES = {packages}
class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if name in SOURCES:
            return importlib.util.spec_from_loader(name, self, is_package=name in PACKAGES)
        return None
    def create_module(self, spec):
        return None
    def exec_module(self, module):
        name = module.__name__
        path = "fdl-agent/" + name.replace(".", "/") + ("/__init__.py" if name in PACKAGES
                                                       else ".py")
        exec(compile(SOURCES[name], path, "exec"), module.__dict__)
sys.meta_path.insert(0, _Finder())
from fdl_fabric.agent.main import main
sys.exit(main())
'''


def _source_of(name: str) -> str:
    root = Path(__file__).resolve().parent.parent
    rel = Path(*name.split("."))
    path = root / rel / "__init__.py" if name in _PACKAGES else root / rel.with_suffix(".py")
    if name == "fdl_fabric":
        return '"""fdl-fabric, as shipped to a host: the agent and the rank client only."""\n'
    return path.read_text(encoding="utf-8")


@functools.lru_cache(maxsize=1)
def payload() -> bytes:
    """The length header and the loader with every module's source (built once)."""
    sources = {name: _source_of(name) for name in (*_PACKAGES, *_MODULES)}
    code = _LOADER.format(sources=repr(sources), packages=repr(set(_PACKAGES))).encode()
    return f"{len(code):0{_HEADER_DIGITS}d}".encode() + code


def remote_command() -> str:
    """The command an SSH session runs: the host's python3 with the bootstrap."""
    boot = quote(BOOTSTRAP)
    return f'p=/usr/bin/python3; [ -x "$p" ] || p=python3; exec "$p" -I -S -c {boot}'


def local_command(python: str) -> str:
    """The command a local agent runs (through invoke's shell): ``python`` with the bootstrap."""
    return f"exec {quote(python)} -I -S -c {quote(BOOTSTRAP)}"


def source_paths() -> list[str]:
    """Files the bundle is made of (for tests that check they stay standalone)."""
    root = Path(__file__).resolve().parent.parent
    out = []
    for name in (*_PACKAGES[1:], *_MODULES):
        rel = Path(*name.split("."))
        path = root / rel / "__init__.py" if name in _PACKAGES else root / rel.with_suffix(".py")
        out.append(os.fspath(path))
    return out
