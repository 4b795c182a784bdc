"""What a CG iteration would cost at 10^3, 10^4 and 10^5 processes: a model fitted
to ``benchmarks/overlap.py``'s measurements, with published allreduce latencies.

Usage::

    mpiexec -n 2 python benchmarks/overlap.py --json overlap.json
    python benchmarks/scale_model.py overlap.json [--procs 1000,10000,100000]

The model, per variant, for a reduction latency ``L`` (µs)::

    t(L) = t0 + k * max(0, L - h)

``t0``: the measured time per iteration with no simulated latency (compute, and
the on-node reduction of two ranks); ``k``: the reductions an iteration waits for
(``classic`` 2, the others 1); ``h``: the work a reduction is overlapped with,
``pipelined_nb``'s preconditioner and matvec (``overlap.py``'s micro ``matvec_us``
for that grid), 0 for the blocking variants. Weak scaling: each rank keeps the
local block it had in the measurement, and so its compute.

First the model is checked against ``overlap.py``'s ``latency`` rows, the same
solve with every reduction held ``L`` µs (the PMPI interposer ``pmpi_latency.c``):
measured, model, and their ratio. Then ``L(P)`` comes from published 8-byte
allreduce latencies (:data:`PUBLISHED`) as ``b * log2(P)``, a recursive-doubling
or tree allreduce's depth times a cost per level taken from one published point,
and ``t(L(P))`` is printed per variant. Not modelled: OS noise and load imbalance
(``overlap.py``'s ``noise`` and ``rank1`` rows measure those), and the matvec's
own halo exchange across nodes.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass

#: Reductions an iteration waits for, per mpi4jax_dist.cg variant (mpi4jax backend).
WAITS = {"classic": 2, "single": 1, "pipelined": 1, "pipelined_nb": 1}
#: Variants whose reduction is in flight during the preconditioner and matvec.
OVERLAPPED = {"pipelined_nb"}


@dataclass(frozen=True)
class Published:
    """A published small-message allreduce latency, and where it is from."""

    name: str
    latency_us: float
    procs: int
    source: str

    @property
    def per_level_us(self) -> float:
        """µs per level of a log2(P)-deep reduction, fitted through this point."""
        return self.latency_us / math.log2(self.procs)


PUBLISHED = (
    Published(
        "InfiniBand EDR, host-based",
        6.01,
        128,
        "8-byte MPI_Allreduce on 128 hosts, 6.01 us host-based (2.83 us with "
        "SHArP): Graham et al., 'Scalable Hierarchical Aggregation Protocol "
        "(SHArP)', COMHPC@SC 2016, doi:10.1109/COMHPC.2016.006",
    ),
    Published(
        "Quadrics QsNetII",
        22.0,
        2048,
        "'the average time to execute a 2048 process global sum being 22 "
        "microsecs' (512 nodes x 4 CPUs): 'Optimised Global Reduction on "
        "QsNetII', Hot Interconnects 2005, doi:10.1109/CONECT.2005.28",
    ),
)


def fit(rows: list[dict]) -> dict:
    """``{n: {"t0": {variant: µs}, "h": µs, "measured": {L: {variant: µs}}}}``
    from overlap.py's result rows."""
    grids: dict = {}
    for row in rows:
        g = grids.setdefault(row["n"], {"t0": {}, "h": None, "measured": {}})
        if row.get("micro"):
            if row.get("latency_us", 0) == 0:
                g["h"] = row["matvec_us"]
        elif row.get("mode") == "latency":
            times = {v: row[v] for v in WAITS if v in row}
            if row["delay_us"] == 0:
                g["t0"] = times
            else:
                g["measured"][row["delay_us"]] = times
    return {n: g for n, g in grids.items() if g["t0"] and g["h"] is not None}


def model(t0: float, variant: str, latency: float, h: float) -> float:
    """The time per iteration of ``variant`` at reduction latency ``latency``."""
    hidden = h if variant in OVERLAPPED else 0.0
    return t0 + WAITS[variant] * max(0.0, latency - hidden)


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json", help="overlap.py --json output (latency mode)")
    parser.add_argument("--procs", default="1000,10000,100000")
    args = parser.parse_args(argv)
    procs = [int(p) for p in args.procs.split(",") if p]
    with open(args.json) as f:
        saved = json.load(f)
    grids = fit(saved["results"])
    if not grids:
        parser.error(
            f"{args.json}: no latency rows at delay 0 with a micro row at latency 0; "
            f"run overlap.py with --mode latency --delays 0,... --micro-latencies 0"
        )
    out = []
    print("# model check: t(L) = t0 + k * max(0, L - h), against overlap.py's")
    print("# simulated-latency rows (us per iteration; model/measured)")
    for n, g in sorted(grids.items()):
        variants = list(g["t0"])
        print(
            f"# n={n}: h (matvec) {g['h']:.1f} us; t0 "
            + ", ".join(f"{v} {g['t0'][v]:.1f}" for v in variants)
        )
        print("#   L_us  " + "  ".join(f"{v:>22}" for v in variants))
        for latency, times in sorted(g["measured"].items()):
            cells = []
            for v in variants:
                predicted = model(g["t0"][v], v, latency, g["h"])
                cells.append(
                    f"{times[v]:7.1f} {predicted:7.1f} {predicted / times[v]:5.2f}"
                )
                out.append(
                    {
                        "n": n,
                        "variant": v,
                        "latency_us": latency,
                        "measured_us": times[v],
                        "model_us": predicted,
                    }
                )
            print(f"  {latency:5g}  " + "  ".join(f"{c:>22}" for c in cells))
    print("# predicted us per iteration at P processes, L(P) = b * log2(P), b from:")
    for pub in PUBLISHED:
        print(f"#   {pub.name}: b = {pub.per_level_us:.2f} us per level; {pub.source}")
    for pub in PUBLISHED:
        for n, g in sorted(grids.items()):
            variants = list(g["t0"])
            print(f"# {pub.name}, n={n}")
            print("#        P   L_us  " + "  ".join(f"{v:>12}" for v in variants))
            for p in procs:
                latency = pub.per_level_us * math.log2(p)
                times = [model(g["t0"][v], v, latency, g["h"]) for v in variants]
                print(
                    f"  {p:7d}  {latency:5.1f}  "
                    + "  ".join(f"{t:12.1f}" for t in times)
                )
                out.append(
                    {
                        "n": n,
                        "network": pub.name,
                        "procs": p,
                        "latency_us": latency,
                        **dict(zip(variants, times, strict=True)),
                    }
                )
    return out


if __name__ == "__main__":
    main()
