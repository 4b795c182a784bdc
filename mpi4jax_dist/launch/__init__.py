"""Starting JAX's distributed runtime from MPI: the cluster envs, the bootstrap,
what a bootstrapped process installs, and what they need (launcher detection,
network, devices, limits and timeouts)."""
