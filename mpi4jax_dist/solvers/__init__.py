"""Distributed conjugate gradients (the public module is :mod:`mpi4jax_dist.cg`):
the recurrences and variants (``core``), how a solve is compiled and reduces
(``backends``), the solvers over split vectors (``distributed``), the drop-in for
``jax.scipy.sparse.linalg.cg`` (``dropin``), the normal equations (``normal``),
and the reductions counted in a traced program (``counting``)."""
