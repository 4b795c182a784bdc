"""Where the time of the collectives goes: the timeline of every call on every
rank (:mod:`.timeline`), on clocks measured against rank 0's (:mod:`.clocks`).
Merged and summarized by ``python -m mpi4jax_dist timeline DIR``
(mpi4jax_dist/diagnostics/timeline.py)."""
