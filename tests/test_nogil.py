"""The Cython hot paths run without the GIL from start to return.

A ``noexcept nogil`` function with a Python object in a variable (one assigned
in a ``with gil`` block) makes Cython take the GIL at every return, to release
the object: once per request, and, while another thread of the process runs
Python code, a wait of up to the interpreter's switch interval. Read from the
C that Cython generated for the build in place.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "coordkit"
FUNCTION = re.compile(r"\nstatic [^;{]*?\b(__pyx_f_\w+)\([^;{]*\) \{\n(.*?)\n\}\n", re.S)


def gil_at_return(source: str) -> list[str]:
    """The functions whose normal exit (after Cython's ``__pyx_L0`` label) takes the GIL."""
    found = []
    for match in FUNCTION.finditer(source):
        body = match.group(2)
        end = body.rfind("__pyx_L0:;")
        if end >= 0 and "__Pyx_PyGILState_Ensure" in body[end:]:
            found.append(match.group(1))
    return found


@pytest.mark.c_extension
@pytest.mark.parametrize("module", ["_loop_c", "_engine_c", "_client_c", "_codec_c", "_routing_c"])
def test_no_hot_path_takes_the_gil_to_return(module):
    generated = PACKAGE / f"{module}.c"
    if not generated.exists():
        pytest.skip(f"{generated.name} is not here (not built in place)")
    assert gil_at_return(generated.read_text()) == []


def test_the_check_finds_a_python_variable_in_a_nogil_function():
    source = """
static void __pyx_f_8coordkit_7_loop_c_4Loop__submit(int __pyx_v_client) {
  PyObject *__pyx_v_rid = NULL;
  goto __pyx_L0;
  __pyx_L1_error:;
  __pyx_gilstate_save = __Pyx_PyGILState_Ensure();
  __Pyx_WriteUnraisable("coordkit._loop_c.Loop._submit", 0, 0, 0, 1, 0);
  __Pyx_PyGILState_Release(__pyx_gilstate_save);
  __pyx_L0:;
  __pyx_gilstate_save = __Pyx_PyGILState_Ensure();
  __Pyx_XDECREF(__pyx_v_rid);
  __Pyx_PyGILState_Release(__pyx_gilstate_save);
}

static void __pyx_f_8coordkit_7_loop_c_4Loop__drain(int __pyx_v_client) {
  goto __pyx_L0;
  __pyx_L1_error:;
  __pyx_gilstate_save = __Pyx_PyGILState_Ensure();
  __Pyx_WriteUnraisable("coordkit._loop_c.Loop._drain", 0, 0, 0, 1, 0);
  __Pyx_PyGILState_Release(__pyx_gilstate_save);
  __pyx_L0:;
}
"""
    assert gil_at_return(source) == ["__pyx_f_8coordkit_7_loop_c_4Loop__submit"]
