"""The ``fdl-fabric`` console script: an invoke Program over the task collection."""

from __future__ import annotations

from invoke.program import Program

from . import __version__
from .tasks import ns

program = Program(namespace=ns, version=__version__, name="fdl-fabric", binary="fdl-fabric")
