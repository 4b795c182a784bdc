"""What ``import mpi4jax_dist`` costs over ``import jax``.

    python benchmarks/import_time.py [--repeat N] [--json PATH]

Each sample is a fresh interpreter that imports jax, then mpi4jax_dist, timing both;
prints the medians over --repeat samples and checks that importing started neither
MPI nor a JAX backend. ``--json PATH`` writes the medians and every sample.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness  # noqa: E402

_SAMPLE = """
import json, sys, time
t0 = time.perf_counter()
import jax
t1 = time.perf_counter()
import mpi4jax_dist
t2 = time.perf_counter()
from jax._src import xla_bridge
print(json.dumps({"jax": t1 - t0, "extra": t2 - t1,
                  "mpi": "mpi4py.MPI" in sys.modules,
                  "backend": xla_bridge.backends_are_initialized()}))
"""


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--json", metavar="PATH", help="write meta and results here")
    args = parser.parse_args(argv)
    samples = [
        json.loads(
            subprocess.run(
                [sys.executable, "-c", _SAMPLE],
                check=True,
                capture_output=True,
                text=True,
            ).stdout
        )
        for _ in range(args.repeat)
    ]
    jax_s = statistics.median(s["jax"] for s in samples)
    extra_s = statistics.median(s["extra"] for s in samples)
    print(f"# median of {args.repeat} fresh interpreters")
    print(f"import jax                       {jax_s * 1e3:8.1f} ms")
    print(
        f"import mpi4jax_dist (after jax)  {extra_s * 1e3:8.1f} ms  "
        f"({100 * extra_s / jax_s:.1f} % of import jax)"
    )
    print(
        f"MPI initialized by import: {any(s['mpi'] for s in samples)}; "
        f"backend initialized: {any(s['backend'] for s in samples)}"
    )
    result = {
        "jax_s": jax_s,
        "extra_s": extra_s,
        "share": extra_s / jax_s,
        "repeat": args.repeat,
        "mpi_initialized": any(s["mpi"] for s in samples),
        "backend_initialized": any(s["backend"] for s in samples),
        "samples": samples,
    }
    _harness.save(
        args,
        _harness.meta(
            args=vars(args),
            timing="median over --repeat fresh interpreters of import jax, then "
            "of import mpi4jax_dist after it",
        ),
        [result],
    )
    return {"jax_s": jax_s, "extra_s": extra_s}


if __name__ == "__main__":
    main()
