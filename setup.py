"""Build mpi4jax_dist's compiled part; the metadata lives in setup.cfg.

The build machinery lives in ``conf/``, as mpi4py keeps its own:
``conf/mpiconfig.py`` finds the MPI compiler wrapper of the MPI mpi4py uses and
learns its flags, ``conf/cudaconfig.py`` finds a CUDA runtime, and
``conf/builder.py`` declares the modules and builds them (``build_ext``), once per
install. ``pip install --no-build-isolation .`` builds against the jaxlib, nanobind
and mpi4py already installed (tools/setup.sh does this); with build isolation pip
installs jaxlib and nanobind for the build first. docs/installation.rst says what
a user may set.
"""

import os
import sys

from setuptools import setup

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "conf"))
from builder import BuildExt, extensions  # noqa: E402

setup(ext_modules=extensions(), cmdclass={"build_ext": BuildExt})
