"""Sphinx configuration: ``python -m sphinx -W -b html docs docs/_build/html``.

Built in CI with warnings as errors (tools/test.sh). The API pages come from the
docstrings (autodoc, Google style through napoleon); the environment-variable
table and the CLI's help come from the code itself (``_ext/mpi4jax_dist_docs.py``),
so that neither can drift from what the package reads and prints.
"""

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "_ext"))
sys.path.insert(0, str(HERE.parent))

import mpi4jax_dist  # noqa: E402

project = "mpi4jax_dist"
author = "The mpi4jax_dist developers"
copyright = "2026, " + author
release = mpi4jax_dist.__version__
version = release

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.intersphinx",
    "mpi4jax_dist_docs",
]

exclude_patterns = ["_build"]
# The pages are the documentation; README.rst is the front page on an index.
root_doc = "index"
nitpicky = False
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
# A public function's "Messages:" section, after its "Raises:", quotes the argument
# errors it raises, as tests/docs/test_docs_errors.py reads them (a directive inside a
# Raises entry would be flattened into its text).
napoleon_custom_sections = ["Messages"]
# No network in CI: the links to JAX's and mpi4py's docs are plain links.
intersphinx_mapping = {}

html_theme = "alabaster"
html_theme_options = {
    "description": "jax.distributed.initialize() under any MPI launcher",
    "fixed_sidebar": True,
}
html_static_path = []
