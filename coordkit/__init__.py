"""coordkit: a data-parallel inference coordinator, in Cython and in pure Python.

The implementation is chosen once, here, from the environment:

* ``COORDKIT_PUREPYTHON=1`` selects the pure-Python reference;
* otherwise the Cython extensions are imported, and if that fails the package
  falls back to pure Python with a ``RuntimeWarning`` naming the import error;
* ``COORDKIT_REQUIRE_EXTENSION=1`` turns that fallback into an ``ImportError``.

``coordkit.IMPLEMENTATION`` says which one is live (``"c"`` or ``"py"``);
:func:`load_implementation` gives either one explicitly, for tests and
benchmarks that compare them.
"""

from __future__ import annotations

import importlib
import os
import warnings
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from .client import Client, CoordinatorError
from .protocol import ErrorCode, Header, ProtocolError

__all__ = [
    "IMPLEMENTATION",
    "Coordinator",
    "Router",
    "codec",
    "load_implementation",
    "Header",
    "ErrorCode",
    "ProtocolError",
    "Client",
    "CoordinatorError",
    "Engine",
    "FakeEngine",
]
__version__ = "0.1.0"

#: The paired modules, by role: each has an ``_x_py`` and an ``_x_c`` twin.
_MODULES = ("codec", "routing", "coordinator")


def _flag(name: str) -> bool:
    return os.environ.get(name, "") not in ("", "0")


def load_implementation(name: str) -> SimpleNamespace:
    """The ``"c"`` or ``"py"`` implementation as a namespace of its modules.

    Raises ``ImportError`` when ``name`` is ``"c"`` and the extension cannot
    be imported.
    """
    if name not in ("c", "py"):
        raise ValueError(f"implementation must be 'c' or 'py', not {name!r}")
    modules = {role: importlib.import_module(f"coordkit._{role}_{name}") for role in _MODULES}
    return SimpleNamespace(
        name=name,
        codec=modules["codec"],
        Router=modules["routing"].Router,
        Coordinator=modules["coordinator"].Coordinator,
    )


def _select() -> SimpleNamespace:
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
            stacklevel=2,
        )
        return load_implementation("py")


_impl = _select()
IMPLEMENTATION: str = _impl.name
codec = _impl.codec
Router = _impl.Router
Coordinator = _impl.Coordinator

if TYPE_CHECKING:
    from .engine import Engine
    from .tools.fake_engine import FakeEngine


def __getattr__(name: str) -> Any:
    # Lazy: importing coordkit loads neither the engine side nor the tools.
    if name == "Engine":
        from .engine import Engine

        return Engine
    if name == "FakeEngine":
        from .tools.fake_engine import FakeEngine

        return FakeEngine
    raise AttributeError(f"module 'coordkit' has no attribute {name!r}")
