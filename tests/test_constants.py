"""The constants the Cython modules use are generated from the Python declarations.

``coordkit/_constants.pxd`` is written by ``buildutils/constants.py`` from
``coordkit/protocol.py`` and ``coordkit/_shared.py``; a stale file, or an
extension compiled from one, must not pass unnoticed.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from coordkit._shared import CYTHON_ENUMS, check_constants, cython_constants

ROOT = Path(__file__).resolve().parent.parent
GENERATOR = ROOT / "buildutils" / "constants.py"


def test_the_generated_file_is_current():
    result = subprocess.run(
        [sys.executable, str(GENERATOR), "--check"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr


def test_every_member_is_declared_under_its_prefixed_name():
    text = (ROOT / "coordkit" / "_constants.pxd").read_text()
    for enum, prefix in CYTHON_ENUMS:
        for member in enum:
            assert f"    {prefix}{member.name} = {int(member)}\n" in text, (enum, member)


def test_a_module_compiled_from_stale_constants_refuses_to_import():
    compiled = cython_constants()
    compiled["Header.CONNECT"] = 99
    del compiled["Counter.SUBMITTED"]
    with pytest.raises(ImportError, match=r"Counter\.SUBMITTED, Header\.CONNECT"):
        check_constants(compiled)
    check_constants(cython_constants())  # today's values pass
