"""Who says a line: the prefix every launcher and coordinator line starts with (a grep for
``cluster launcher: failed:`` finds every failed run), one source for every wording module."""

L = "cluster launcher: "
C = "cluster coordinator: "

__all__ = ["C", "L"]
