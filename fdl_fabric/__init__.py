"""fdl-fabric: launch and supervise multi-host training jobs over SSH."""

__version__ = "0.1.0"
