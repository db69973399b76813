"""How the ``coordkit`` commands parse their options and report a mistake.

* :class:`Parser`: a usage error is one line, ``coordkit <command>: <what is
  wrong>``, and exit status 2 (argparse's own code), never the usage block;
* :class:`HelpFormatter`: every option's help says its default;
* :func:`add_removed`: an option that is gone names its replacement;
* :func:`run`: a command's own refusal (a ValueError, an OSError such as
  ConnectionError or TimeoutError, a ZMQError such as an address in use, an
  ImportError naming the extra to install) is that one line and exit status 2 too.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any, NoReturn

import zmq

__all__ = ["USAGE_ERROR", "HelpFormatter", "Parser", "add_removed", "message", "run"]

#: The exit status of a command that could not do what it was asked: argparse's.
USAGE_ERROR = 2

_PACKAGE_TAG = "coordkit: "  # how the package's own messages start


def message(exc: BaseException) -> str:
    """An exception's text for a command's line: the package's own tag is the command's."""
    return str(exc).removeprefix(_PACKAGE_TAG)


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (``prog: message``), exit status 2."""

    def __init__(self, *args: Any, **kwargs: Any):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(USAGE_ERROR, f"{self.prog}: {message} (see {self.prog} --help)\n")


class HelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with ``(default: X)``, unless it says its default
    already; a flag's default is not to do what it says. An option whose
    default is None must say in its own words what that means."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (
            "default" in text
            or not action.option_strings
            or action.nargs == 0
            or action.required
            or default is None
            or default is argparse.SUPPRESS
        ):
            return text
        if isinstance(default, (list, tuple)):
            default = " ".join(map(str, default))
        shown = str(default).replace("%", "%%")
        return f"{text} (default: {shown})" if text else f"default: {shown}"


class _Removed(argparse.Action):
    """An option that is gone: using it is an error naming what replaced it."""

    def __init__(self, *args: Any, replacement: str, **kwargs: Any):
        self.replacement = replacement
        super().__init__(*args, **kwargs)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        parser.error(f"{option_string} is gone: use {self.replacement}")


def add_removed(parser: argparse.ArgumentParser, removed: dict[str, tuple[str, str]]) -> None:
    """Hidden options for the keyword arguments that are gone (``{name: (replacement,
    how)}``, as ``Coordinator`` keeps them): each an error naming its replacement."""
    for name, (replacement, how) in removed.items():
        parser.add_argument(
            "--" + name.replace("_", "-"),
            action=_Removed,
            nargs="?",
            help=argparse.SUPPRESS,
            replacement=f"--{replacement.replace('_', '-')} ({how})",
        )


def run(name: str, command: Callable[[], int | None]) -> int:
    """Run ``coordkit <name>``: its exit status, or USAGE_ERROR and one line on stderr
    when it refused what it was asked (see the module's docstring)."""
    try:
        return command() or 0
    except (ValueError, OSError, zmq.ZMQError, ImportError) as exc:
        print(f"coordkit {name}: {message(exc)}", file=sys.stderr, flush=True)
        return USAGE_ERROR
