"""``python -m offload ...``: the same as the ``offload`` console script."""

from .tools.cli import main

raise SystemExit(main())
