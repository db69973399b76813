"""``python -m coordkit``: the ``coordkit`` command."""

from .cli import main

raise SystemExit(main())
