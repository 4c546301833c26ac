"""``python -m offload ...``: the same as the ``offload`` console script."""

from .cli import main

raise SystemExit(main())
