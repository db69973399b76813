"""Every Python block of README.md and docs/*.md runs as written, on both implementations.

A page's ```python blocks are joined, in order, into one script, run in a fresh
interpreter in an empty directory with a bounded timeout: a block may use what
an earlier block of its page defined, and one that needs a coordinator or an
engine starts it itself. The implementation is chosen as a user would, from
the environment (``COORDKIT_PUREPYTHON=1`` for ``py``). A block that cannot
run here (it needs Megatron-Core, or is a host's setup.py) says why on the line
before it, ``<!-- snippet: not run (REASON) -->``; anything else that is not
Python has a fence language of its own, so no Python block goes unrun by
being unlabelled.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TIMEOUT = 60  # seconds per page and implementation; each takes about one

#: An opening or closing fence, its indentation and its language (empty for a closing one).
FENCE = re.compile(r"^(?P<indent> *)```(?P<language>[^`\s]*)\s*$")
NOT_RUN = re.compile(r"^\s*<!-- snippet: not run \((?P<reason>[^)]+)\) -->\s*$")
#: Names under which a Python block would be highlighted but not run: use ``python``.
PYTHON_ALIASES = {"py", "python3", "py3", "pycon", "pyi"}


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    language: str
    code: str
    not_run: str | None  # the reason given, for a block that is not run


def blocks(page: Path) -> list[Block]:
    """The fenced blocks of ``page``, in order."""
    found: list[Block] = []
    lines = page.read_text().splitlines()
    index = 0
    while index < len(lines):
        opening = FENCE.match(lines[index])
        if opening is None:
            index += 1
            continue
        start, indent = index, opening["indent"]
        body: list[str] = []
        index += 1
        while index < len(lines) and lines[index].rstrip() != f"{indent}```":
            body.append(lines[index])
            index += 1
        if index == len(lines):
            raise AssertionError(f"{page.name}:{start + 1}: a fence that is never closed")
        marker = NOT_RUN.match(lines[start - 1]) if start else None
        code = textwrap.dedent("\n".join(body)) + "\n"
        found.append(
            Block(page, start + 1, opening["language"], code, marker["reason"] if marker else None)
        )
        index += 1
    return found


def script(page: Path) -> str:
    return "\n".join(
        block.code for block in blocks(page) if block.language == "python" and block.not_run is None
    )


RUNNABLE = [page for page in PAGES if script(page)]


@pytest.mark.parametrize("page", RUNNABLE, ids=[page.name for page in RUNNABLE])
def test_the_page_runs(page: Path, impl, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("COORDKIT_")}
    env["COORDKIT_PUREPYTHON" if impl.name == "py" else "COORDKIT_REQUIRE_EXTENSION"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    path = tmp_path / f"{page.stem}.py"
    path.write_text(script(page))
    result = subprocess.run(
        [sys.executable, str(path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert result.returncode == 0, f"{page.name} on {impl.name}:\n{result.stderr}"


def test_every_block_says_what_it_is() -> None:
    """A fence has a language, Python is spelled ``python``, and a marker is on a Python block."""
    problems = []
    for page in PAGES:
        for block in blocks(page):
            where = f"{page.relative_to(ROOT)}:{block.line}"
            if not block.language:
                problems.append(f"{where}: a fence without a language")
            elif block.language in PYTHON_ALIASES:
                problems.append(f"{where}: Python fenced as {block.language!r}: use 'python'")
            elif block.not_run is not None and block.language != "python":
                problems.append(f"{where}: a not-run marker on a {block.language} block")
    assert problems == []


def test_the_readme_quick_start_is_run() -> None:
    """The README's quick start is a Python block that is run, not one marked not run."""
    readme = blocks(ROOT / "README.md")
    assert [b for b in readme if b.language == "python" and b.not_run is None]
    assert all(b.not_run is None for b in readme)


def test_the_readmes_links_lead_somewhere() -> None:
    """The README is read on GitHub and PyPI, outside the site mkdocs checks: its links too."""
    readme = (ROOT / "README.md").read_text()
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme)
    local = [target for target in targets if "://" not in target]
    assert local
    assert [target for target in local if not (ROOT / target).exists()] == []


def test_the_parser_finds_what_it_must(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "text\n\n```python\nx = 1\n```\n\n"
        "- item\n\n  ```python\n  y = x\n  ```\n\n"
        "<!-- snippet: not run (needs a GPU) -->\n```python\nimport torch\n```\n\n"
        "```\nbare\n```\n\n```py\nz = 2\n```\n"
    )
    found = blocks(page)
    assert [(b.language, b.not_run) for b in found] == [
        ("python", None),
        ("python", None),
        ("python", "needs a GPU"),
        ("", None),
        ("py", None),
    ]
    assert script(page) == "x = 1\n\ny = x\n"
