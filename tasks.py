"""`inv launch`, `inv cleanup`, `inv prebuild-check` in this repo: the fdl-fabric collection."""

from fdl_fabric.tasks import ns

__all__ = ["ns"]
