"""The two implementations, and the choice between them made once per process.

``coordkit/__init__.py`` makes the choice (:func:`selected`) from the
environment, as msgpack does:

* ``COORDKIT_PUREPYTHON=1`` selects the pure-Python reference;
* otherwise the Cython extensions are imported, and if that fails the package
  falls back to pure Python with a ``RuntimeWarning`` naming the import error;
* ``COORDKIT_REQUIRE_EXTENSION=1`` turns that fallback into an ``ImportError``.
"""

from __future__ import annotations

import functools
import importlib
import os
import warnings
from dataclasses import dataclass
from types import ModuleType
from typing import Any

__all__ = ["Implementation", "load_implementation", "selected"]

#: The paired modules, by role: each has an ``_x_py`` and an ``_x_c`` twin.
_ROLES = ("codec", "routing", "loop", "client", "engine")


@dataclass(frozen=True)
class Implementation:
    """One implementation's modules: the Cython (``"c"``) or the Python (``"py"``) twins."""

    name: str
    codec: ModuleType
    routing: ModuleType
    loop: ModuleType
    client: ModuleType
    engine: ModuleType

    @property
    def Router(self) -> Any:  # noqa: N802 - the class it names
        return self.routing.Router


@functools.cache
def load_implementation(name: str) -> Implementation:
    """The ``"c"`` or ``"py"`` implementation; ImportError when ``"c"`` cannot be imported."""
    if name not in ("c", "py"):
        raise ValueError(f"implementation must be 'c' or 'py', not {name!r}")
    # relative to this package: a vendored copy loads its own cores, never an installed coordkit's
    modules = {role: importlib.import_module(f"._{role}_{name}", __package__) for role in _ROLES}
    return Implementation(name, **modules)


def _flag(name: str) -> bool:
    return os.environ.get(name, "") not in ("", "0")


@functools.cache
def selected() -> Implementation:
    """The implementation chosen from the environment (see the module docstring)."""
    if _flag("COORDKIT_PUREPYTHON"):
        return load_implementation("py")
    try:
        return load_implementation("c")
    except ImportError as exc:
        if _flag("COORDKIT_REQUIRE_EXTENSION"):
            raise ImportError(
                "coordkit: COORDKIT_REQUIRE_EXTENSION=1 but the C extension failed to import: "
                f"{exc}"
            ) from exc
        warnings.warn(
            f"coordkit: the C extension failed to import ({exc}); "
            "using the pure-Python implementation",
            RuntimeWarning,
            stacklevel=3,
        )
        return load_implementation("py")
