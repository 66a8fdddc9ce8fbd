"""`python -m engine_sim`: see `engine_sim.cli`."""

from engine_sim.cli import main

raise SystemExit(main())
