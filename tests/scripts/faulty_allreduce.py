"""benchmarks/allreduce.py with two faulty implementations registered beside mpi4jax.

    mpiexec -n 2 python tests/scripts/faulty_allreduce.py [allreduce.py options]

``mpi4jax_rolled`` is mpi4jax.allreduce followed by ``jnp.roll(..., 1)`` and
``mpi4jax_reversed`` the same reversed: permutations of a right result, which an
index-blind check cannot see. The run must end with status 1 and a ``WRONG:`` line
for each of them in each mode, and none for mpi4jax itself
(tests/jobs/test_allreduce_faults.py).
"""

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location(
    "allreduce", ROOT / "benchmarks" / "allreduce.py"
)
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


@bench.IMPLS.register("mpi4jax_rolled")
class Rolled(bench.IMPLS["mpi4jax"]):
    """Right values, every element moved one place along."""

    def reduce(self, v):
        return self.jax.numpy.roll(super().reduce(v), 1)


@bench.IMPLS.register("mpi4jax_reversed")
class Reversed(bench.IMPLS["mpi4jax"]):
    """Right values in reverse order."""

    def reduce(self, v):
        return super().reduce(v)[::-1]


if __name__ == "__main__":
    args = sys.argv[1:] or [
        "--sizes",
        "4096",
        "--samples",
        "1",
        "--iters",
        "3",
        "--loop-iters",
        "3",
    ]
    bench.main(["--impls", "mpi4jax,mpi4jax_rolled,mpi4jax_reversed", *args])
