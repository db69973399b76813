"""``python -m coordkit``: the ``coordkit`` command."""

from .tools.cli import main

raise SystemExit(main())
