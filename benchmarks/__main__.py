"""`python -m benchmarks`: see `benchmarks/cli.py`."""

from benchmarks.cli import main

raise SystemExit(main())
