"""The twins are siblings: each C module and its Python twin export the same public names.

As pyzmq holds its backends to one public API: the same ``__all__``, every
name in it present in both, and the classes among them with the same public
methods and properties (a C class's data attributes are its twin's instance
attributes, which the behavioural tests compare).
"""

from __future__ import annotations

from pathlib import Path

import pytest

import coordkit

ROLES = ("codec", "routing", "loop", "client", "engine")


def public(cls: type) -> set[str]:
    return {name for name in dir(cls) if not name.startswith("_")}


def methods(cls: type) -> set[str]:
    return {name for name in public(cls) if callable(getattr(cls, name))}


@pytest.mark.c_extension
@pytest.mark.parametrize("role", ROLES)
def test_the_twins_export_the_same_names(c_impl, py_impl, role):
    c, py = getattr(c_impl, role), getattr(py_impl, role)
    assert sorted(c.__all__) == sorted(py.__all__)
    for name in c.__all__:
        assert hasattr(c, name) and hasattr(py, name), name
        if isinstance(getattr(py, name), type):
            c_class, py_class = getattr(c, name), getattr(py, name)
            assert methods(c_class) == methods(py_class), name
            # a Python property is a C class's property or attribute, by the same name
            assert public(c_class) >= public(py_class), name


def test_no_core_imports_its_twin(c_impl, py_impl):
    """A C core takes nothing from its Python twin (nor the twin from it): what both use
    lives in a module below both (_policies, _events, _shared, protocol)."""
    for role in ROLES:
        c, py = getattr(c_impl, role), getattr(py_impl, role)
        assert py not in vars(c).values(), role
        assert not any(getattr(v, "__module__", None) == py.__name__ for v in vars(c).values())
        assert c not in vars(py).values(), role


def test_every_room_of_the_c_loop_has_its_python_module():
    """``loop/X.pyx`` and ``_loop_py/X.py`` come in pairs: a reader of one opens the other.
    The Python package adds only its ``Loop`` (``loop.py``, _loop_c.pyx's twin) and the
    records of the tables (``tables.py``, _loop_c.pxd's structs)."""
    package = Path(coordkit.__file__).parent
    rooms = {path.stem for path in (package / "loop").glob("*.pyx")}
    modules = {path.stem for path in (package / "_loop_py").glob("*.py")}
    assert rooms == modules - {"__init__", "loop", "tables"}
    assert {path.stem for path in (package / "loop").glob("*.pxd")} == rooms
