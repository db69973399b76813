"""Check coordkit's imports: relative only, and no cycle (``make lint``, tests/test_layout.py).

Every module of the package -- the ``.py`` files, and the ``.pyx``/``.pxd``
ones with the parts they ``include`` -- is read for its imports and cimports:

* none may name the package absolutely (``import coordkit``, ``from coordkit.x
  import y``, ``cimport coordkit._x``): a copy vendored under another name
  would then load, or fail to find, the installed one;
* the graph of imports between the package's modules must have no cycle.
  ``_implementation`` loads the ``_<role>_c`` and ``_<role>_py`` cores by name
  at run time: those edges are counted too. Imports under ``if TYPE_CHECKING:``
  count as well (a cycle of types is a cycle for a reader), but for one kind:
  the rooms of the Python loop core naming each other's types (``_loop_py/X.py``
  naming its ``Loop``), which are parts of one loop as ``loop/*.pyx`` are parts
  of ``_loop_c``.

    python buildutils/imports.py            # print what is wrong; exit 1 if anything is
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "coordkit"

#: The cores _implementation loads by name (its _ROLES), each as _<role>_c and _<role>_py.
DYNAMIC = {"_implementation": [f"_{role}_{name}" for role in (
    "codec", "routing", "loop", "client", "engine") for name in ("c", "py")]}  # fmt: skip

_CYTHON_IMPORT = re.compile(
    r"^\s*(?:from\s+(?P<source>[\w.]+)\s+c?import\s+(?P<names>\([^)]*\)|[^\n]*)"
    r"|c?import\s+(?P<module>[\w.]+))",
    re.M,
)
_INCLUDE = re.compile(r'^include\s+"([^"]+)"', re.M)


def module_name(path: Path, package: Path) -> str:
    """``_codec_c`` for coordkit/_codec_c.pyx, ``tools.cli`` for coordkit/tools/cli.py, ""
    for the package; its ``__init__.pxd`` (cimported only, never imported) apart."""
    parts = path.relative_to(package).with_suffix("").parts
    if path.name == "__init__.pxd":
        return ".".join([*parts[:-1], "__init__.pxd"])
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(name: str, level: int, directory: tuple[str, ...]) -> str:
    """A relative import's target from a module in ``directory`` (the parts of its
    package), as a name within the package ("" is the package itself)."""
    base = list(directory[: len(directory) - (level - 1)])
    return ".".join(filter(None, [*base, name]))


#: The packages whose modules are the parts of one module (as loop/*.pyx are _loop_c's):
#: their TYPE_CHECKING imports of each other are no edges.
PARTS_OF = {"_loop_py"}


def _python_imports(source: str) -> list[tuple[str, int, list[str], bool]]:
    """(module, level, names, only for type checking) of each import in a module."""
    tree = ast.parse(source)
    typing_only: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            typing_only.update(id(child) for stmt in node.body for child in ast.walk(stmt))
    found: list[tuple[str, int, list[str], bool]] = []
    for node in ast.walk(tree):
        only = id(node) in typing_only
        if isinstance(node, ast.Import):
            found += [(alias.name, 0, [], only) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            found.append((node.module or "", node.level, [a.name for a in node.names], only))
    return found


def _cython_imports(path: Path) -> list[tuple[str, int, list[str], bool]]:
    """The same for a .pyx or .pxd and the files it includes (its parts)."""
    text = path.read_text()
    for include in _INCLUDE.findall(text):
        text += "\n" + (path.parent / include).read_text()
    text = re.sub(r'"""[\s\S]*?"""', "", text)  # docstrings and verbatim C
    found = []
    for match in _CYTHON_IMPORT.finditer(text):
        if match["module"]:
            found.append((match["module"], 0, [], False))
            continue
        source = match["source"]
        level = len(source) - len(source.lstrip("."))
        names = [n.strip() for n in re.sub(r"#.*", "", match["names"]).strip("()").split(",")]
        names = [n for n in names if n]
        found.append((source[level:], level, [n.split()[0] for n in names], False))
    return found


def _parts(package: Path) -> set[Path]:
    """The files some .pyx or .pxd includes: read as part of it, not as modules."""
    return {
        (path.parent / include).resolve()
        for pattern in ("*.pyx", "*.pxd")
        for path in package.rglob(pattern)
        for include in _INCLUDE.findall(path.read_text())
    }


def graph(package: Path) -> tuple[dict[str, set[str]], list[str]]:
    """The package's modules and what each imports of them; and the absolute self-imports."""
    top = package.name
    parts = _parts(package)
    sources: dict[str, list[Path]] = {}  # a .pyx and its .pxd are one module
    for path in sorted(package.rglob("*")):
        if path.suffix in (".py", ".pyx", ".pxd") and path.resolve() not in parts:
            sources.setdefault(module_name(path, package), []).append(path)
    edges: dict[str, set[str]] = {name: set() for name in sources}
    absolute: list[str] = []
    for name, paths in sources.items():
        for path in paths:
            if path.suffix == ".py":
                imports = _python_imports(path.read_text())
            else:
                imports = _cython_imports(path)
            for module, level, names, typing_only in imports:
                if level == 0 and (module == top or module.startswith(top + ".")):
                    absolute.append(f"{path.relative_to(package.parent)}: {module}")
                    module = module[len(top) + 1 :]
                elif level == 0:
                    continue  # the standard library, a dependency
                else:
                    directory = path.parent.relative_to(package).parts
                    module = _resolve(module, level, directory)
                # `from . import protocol` imports a module; `from .x import y`, the module x
                submodules = {".".join(filter(None, [module, n])) for n in names} & edges.keys()
                targets = submodules or ({module} & edges.keys())
                home = name.partition(".")[0]
                if typing_only and home in PARTS_OF:  # the parts of one module, typed
                    targets = {t for t in targets if t.partition(".")[0] != home}
                edges[name] |= targets
        edges[name] |= set(DYNAMIC.get(name, ())) & edges.keys()
        edges[name].discard(name)
    return edges, absolute


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(edges[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def problems(package: Path = PACKAGE) -> list[str]:
    edges, absolute = graph(package)
    found = [f"absolute import of the package: {line}" for line in absolute]
    found += [f"import cycle: {' -> '.join(cycle)}" for cycle in cycles(edges)]
    return found


def main() -> int:
    found = problems()
    for line in found:
        print(line, file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    raise SystemExit(main())
