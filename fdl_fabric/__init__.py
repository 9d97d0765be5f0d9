"""fdl-fabric: launch and supervise multi-host training jobs over SSH."""

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    """``fdl_fabric.launch`` and its result types, imported on first use: a training
    script's ``from fdl_fabric import rank`` must not load the launcher (Fabric, paramiko)."""
    if name in ("launch", "LaunchResult", "RankOutcome", "Attempt"):
        from . import api

        return getattr(api, name)
    if name in ("attach", "RunHandle"):
        from . import handle

        return getattr(handle, name)
    raise AttributeError(f"module 'fdl_fabric' has no attribute {name!r}")
