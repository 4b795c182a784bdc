"""``python -m mpi4jax_dist``: the diagnostics' command line
(:mod:`mpi4jax_dist.diagnostics.cli`)."""

import sys

from .diagnostics.cli import main

sys.exit(main())
