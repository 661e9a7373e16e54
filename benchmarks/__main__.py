"""``python -m benchmarks``: the same as ``asynclock bench``."""

from benchmarks import main

raise SystemExit(main())
