"""A griffe extension for the API reference (mkdocs.yml): Sphinx roles as code spans.

The package's docstrings cross-reference with Sphinx roles (``:class:`Client```,
``:meth:`stream```), which mkdocstrings would print as they are; this turns each
into a code span of its target's last name (``~`` and a leading dot dropped).
"""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:py:)?(?:class|meth|func|data|attr|mod|exc|obj):`~?\.?([^`]+)`")


class SphinxRoles(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = ROLE.sub(lambda m: f"`{m[1]}`", obj.docstring.value)
