"""The package's imports: relative only (so it can be vendored under any name), and no cycle.

``buildutils/imports.py`` (``make lint``) reads every module's imports and
cimports, the .pyx parts they include with them; it must pass on the package
and must find the faults it is there to find.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHECK = ROOT / "buildutils" / "imports.py"

sys.path.insert(0, str(CHECK.parent))
import imports  # noqa: E402


def test_the_package_passes():
    result = subprocess.run([sys.executable, str(CHECK)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def write(package: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (package / name).parent.mkdir(parents=True, exist_ok=True)
        (package / name).write_text(text)
    return package


def test_a_cycle_through_a_pyx_and_its_parts_is_found(tmp_path):
    package = write(
        tmp_path / "coordkit",
        {
            "__init__.py": "",
            "a.py": "from . import b\n",
            "b.pyx": 'include "parts/one.pyx"\n',
            "parts/one.pyx": "from .c cimport thing\n",
            "c.pxd": "from .a import x\n",
        },
    )
    assert imports.problems(package) == ["import cycle: a -> b -> c"]


def test_an_absolute_import_of_the_package_is_found(tmp_path):
    package = write(
        tmp_path / "coordkit",
        {
            "__init__.py": "",
            "x.pyx": "from coordkit._y cimport z\n",
            "tools/t.py": "import coordkit\n",
        },
    )
    assert sorted(imports.problems(package)) == [
        "absolute import of the package: coordkit/tools/t.py: coordkit",
        "absolute import of the package: coordkit/x.pyx: coordkit._y",
    ]


def test_the_dynamic_imports_of_the_implementations_count(tmp_path):
    package = write(
        tmp_path / "coordkit",
        {
            "__init__.py": "",
            "_implementation.py": "",
            "_loop_c.pyx": "from . import _implementation\n",
        },
    )
    assert imports.problems(package) == ["import cycle: _implementation -> _loop_c"]


def test_a_cycle_through_type_checking_is_found_but_a_loop_room_naming_its_loop(tmp_path):
    """A cycle of types is one for a reader (``_shared`` naming ``tracing.TraceSink`` was
    one); a room of ``_loop_py`` naming its ``Loop`` is a part of one loop, as C's are."""
    package = write(
        tmp_path / "coordkit",
        {
            "__init__.py": "",
            "a.py": "from . import b\n",
            "b.py": "if TYPE_CHECKING:\n    from .a import x\n",
            "_loop_py/__init__.py": "from .loop import Loop\n",
            "_loop_py/loop.py": "from .room import Room\n",
            "_loop_py/room.py": "if TYPE_CHECKING:\n    from .loop import Loop\n",
        },
    )
    assert imports.problems(package) == ["import cycle: a -> b"]
