"""The reference loop core, one module per room of the C loop (loop/*.pyx)."""

from .loop import Loop

__all__ = ["Loop"]
