"""Coordinator CPU cost per request: ``coordkit bench`` from a checkout (see README)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's coordkit

from coordkit.bench import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
