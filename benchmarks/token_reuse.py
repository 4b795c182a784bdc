"""What JAX's ordered-effect dispatch would cost if it reused its runtime token.

    mpiexec -n 2 python benchmarks/token_reuse.py [--calls 50] [--samples 10]
        [--json PATH]

Every jitted call of a program with an ordered effect (mpi4jax's, which
``mpi4jax_dist.allreduce`` shares) asks JAX for the effect's token input
(``RuntimeTokenSet.get_token_input`` in ``jax/_src/dispatch.py``): JAX builds a
sharding and ``device_put`` s the last call's token, whose handler
(``_token_shard_arg`` in ``jax/_src/array.py``) first waits for that call to end and
then copies an empty host array to the device as the new token. The upstream change
this measures: where the last token is already on this call's device, hand it over
as it is, neither waiting nor copying; the runtime orders the calls through the
token buffer as it does any data dependence.

The package applies the change (``_compat.reuse_runtime_tokens``,
``MPI4JAX_DIST_TOKEN_REUSE``); this script switches that one method between JAX's
own and the change within its run, whatever the setting, and times, in one job,
round-robin, one jitted call at 4 B of each case with JAX's own method and with
the change: an ordered-effect op
that communicates nothing (``mpi4jax_dist.allreduce`` on ``COMM_SELF``),
``mpi4jax.allreduce`` and ``mpi4jax_dist.allreduce`` on ``COMM_WORLD``, and, as the
floor, a jitted call without effects. Each patched result is checked. What the
patch gives up is why JAX waits (jax#25671): an error of the previous call is then
raised at the next ``block_until_ready``, not at the next dispatch.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness  # noqa: E402


def reusing_get_token_input(stock):
    """JAX's ``get_token_input`` with the change: the last token, as it is, where
    it is on exactly this call's devices; JAX's own path otherwise."""
    from jax._src import core

    def get_token_input(self, eff, devices):
        tok = self.current_tokens.get(eff)
        if isinstance(tok, core.Token):
            buf = tok._buf
            if getattr(buf, "devices", None) and buf.devices() == set(devices):
                return tok
        return stock(self, eff, devices)

    return get_token_input


class Patch:
    """Switch the change on and off (``with Patch(on): ...``)."""

    def __init__(self, on: bool):
        from jax._src import dispatch

        self.on, self.cls = on, dispatch.RuntimeTokenSet
        self.found = self.cls.get_token_input
        # JAX's own method, also where the package has put the change in place.
        self.stock = getattr(self.found, "jax_original", self.found)

    def __enter__(self):
        self.found = self.cls.get_token_input
        self.cls.get_token_input = (
            reusing_get_token_input(self.stock) if self.on else self.stock
        )

    def __exit__(self, *exc):
        self.cls.get_token_input = self.found


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=50, help="calls per sample")
    parser.add_argument("--samples", type=int, default=10, help="timed samples")
    _harness.add_output_arguments(parser)
    args = parser.parse_args(argv)

    import mpi4jax_dist  # noqa: F401, I001

    import jax

    if not jax.distributed.is_initialized():
        jax.distributed.initialize()
    import _allreduce_impls
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    procs = comm.Get_size()
    cases = [  # (name, record, communicator, the result of one call on ones)
        ("jit(v + 1)", _allreduce_impls.JitPlusOne, comm, 2.0),
        ("alone on COMM_SELF", _allreduce_impls.Mpi4jaxDist, MPI.COMM_SELF, 1.0),
        ("mpi4jax", _allreduce_impls.Mpi4jax, comm, float(procs)),
        ("mpi4jax_dist", _allreduce_impls.Mpi4jaxDist, comm, float(procs)),
    ]
    impls, timed, wrong = [], [], 0
    for _name, record, where, want in cases:
        impl = record(1, np.float32, where)
        for on in (False, True):
            with Patch(on):
                impl.load(np.ones(1, np.float32))
                impl.call()
                wrong += int(impl.result()[0] != want)
                impl.load(np.zeros(1, np.float32))

            def case(impl=impl, on=on):
                with Patch(on):
                    for _ in range(args.calls):
                        impl.call()

            timed.append(case)
        impls.append(impl)
    with _harness.Compiles() as compiled:
        times = _harness.time_rounds(timed, comm, args.samples)
    rows = []
    for index, (name, *_rest) in enumerate(cases):
        stock, patched = (
            _harness.summary(t / args.calls for t in times[2 * index + j])
            for j in (0, 1)
        )
        rows.append(
            {
                "impl": name,
                "stock_median_s": stock["t_median_s"],
                "reused_median_s": patched["t_median_s"],
                "ratio": patched["t_median_s"] / stock["t_median_s"],
                "stock": stock,
                "reused": patched,
            }
        )
    table = _harness.Table(
        [
            _harness.Column("impl", "one call of", "", 16, left=True),
            _harness.Column("stock_median_s", "JAX as is", "us", 10, ".1f", 1e6),
            _harness.Column("reused_median_s", "reused", "us", 10, ".1f", 1e6),
            _harness.Column("ratio", "ratio", "", 6, ".2f"),
        ]
    )
    meta = _harness.meta(comm, calls=args.calls, samples=args.samples)
    _harness.say(
        comm,
        f"# one jitted call at 4 B, {procs} ranks, jax {meta['versions']['jax']}: "
        f"JAX's token input as installed, and reused where it is on the device "
        f"(a patch of this run only); medians of {args.samples} samples of "
        f"{args.calls} calls; {wrong} wrong, {compiled.count} compiles timed",
        table.header(),
        *(table.row(r) for r in rows),
    )
    _harness.save(args, meta, rows, comm=comm)
    if wrong:
        raise SystemExit(1)
    return rows


if __name__ == "__main__":
    with _harness.results_on_stdout():
        main()
