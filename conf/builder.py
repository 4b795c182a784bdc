"""Declare mpi4jax_dist's compiled part and build it against mpi4py's MPI.

One build per install, as mpi4jax builds its bridge, into ``mpi4jax_dist/_ffi``:

- ``_cpu``: the CPU handlers and the Python module that hands them to JAX
  (``cpu.cc``, bound with nanobind);
- ``_cuda``: the CUDA handler (``cuda.cc``), where a CUDA runtime is found
  (:mod:`cudaconfig`): a module of its own, so that ``_cpu`` never needs CUDA;
- ``_stacks``: a small C module (``stacks.c``, ``stacks_*.c`` and their
  ``stacks.h``; no nanobind, no XLA) whose thread writes a rank's stacks without
  Python's GIL and answers rank 0's requests for them (:mod:`mpi4jax_dist.faults`);
- ``_mpiabi``: not a Python module but a plain C library, the MPIABI wrapper that
  jaxlib's MPItrampoline loads (``MPITRAMPOLINE_LIB``) for XLA's MPI collectives
  on CPU (``mpiabi.c``, ``mpiabi_*.c`` and their ``mpiabi.h``). It links against
  MPI alone (``-Wl,--no-undefined`` checks that) and exports only the ABI's names;
  :mod:`mpiabi_gen` writes its constants and stubs into the build directory, as
  ``mpiabi_generated.c``, a source of its own.

All are compiled against the MPI whose wrapper :mod:`mpiconfig` finds, with its
flags, and the modules against XLA's FFI headers from the jaxlib installed
(``pip install --no-build-isolation`` uses the environment's own). Nothing is
looked for before ``build_ext`` runs: making an sdist needs no MPI.

Beside the modules the build writes ``_build.<Python's suffix>.json``
(``_build.cpython-312-x86_64-linux-gnu.json``): the MPI family they call,
their files and the configuration they were built with. The loader
(``mpi4jax_dist/_ffi/__init__.py``) reads the family before it imports a module;
a build directory kept from another configuration is built again, not shipped.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import sys
import sysconfig
from pathlib import Path

import cudaconfig
import mpiabi_gen
import mpiconfig
from setuptools import Extension
from setuptools.command.build_ext import build_ext

PACKAGE = "mpi4jax_dist._ffi"
KINDS = ("cpu", "cuda", "stacks", "mpiabi")
FFI = Path(*PACKAGE.split("."))
ROOT = Path(__file__).resolve().parent.parent
# The build's record, named for this Python as its modules are (editable installs
# of several Pythons into one tree each keep their own build).
SUFFIX = sysconfig.get_config_var("EXT_SUFFIX")
RECORD = "_build" + os.path.splitext(SUFFIX)[0] + ".json"
# No MPI C++ bindings (gone from the standard; old MPIs add them).
MACROS = [("OMPI_SKIP_MPICXX", "1"), ("MPICH_SKIP_MPICXX", "1")]
# What nanobind's own CMake compiles its library with (nanobind_build_library,
# release): its sources are not ours to keep warning-free under -Wall -Wextra.
NANOBIND_FLAGS = ["-std=c++17", "-Os", "-fvisibility=hidden", "-fno-strict-aliasing"]
NANOBIND_FLAGS += ["-ffunction-sections", "-fdata-sections", "-DNB_COMPACT_ASSERTIONS"]
# Modules of older builds, named per MPI family (_cpu_mpich...), which a kept
# build directory or an editable tree may still hold.
FAMILY_NAMED = re.compile(r"_(cpu|cuda|mpiabi)_\w+\..*")


def extensions() -> list[Extension]:
    """The compiled part, as declared; :class:`BuildExt` adds the flags."""
    headers = sorted(str(FFI / p.name) for p in (ROOT / FFI).glob("*.h"))
    # The C modules' headers and sources are named for them (stacks_dump.h,
    # mpiabi.h, mpiabi_record.c); the other headers are the C++ modules'.
    own = {
        kind: [h for h in headers if re.match(rf"{kind}[._]", Path(h).name)]
        for kind in ("stacks", "mpiabi")
    }
    c_sources = {
        kind: sorted(
            str(FFI / p.name)
            for p in (ROOT / FFI).glob("*.c")
            if re.fullmatch(rf"{kind}(_\w+)?\.c", p.name)
        )
        for kind in ("stacks", "mpiabi")
    }
    cc_headers = [h for h in headers if h not in own["stacks"] + own["mpiabi"]]
    return [
        Extension(
            f"{PACKAGE}._{kind}",
            [str(FFI / f"{kind}.cc")],
            depends=cc_headers,
            language="c++",
        )
        for kind in KINDS[:2]
    ] + [
        Extension(
            f"{PACKAGE}._stacks",
            c_sources["stacks"],
            depends=own["stacks"],
            language="c",
        ),
        Extension(
            f"{PACKAGE}._mpiabi",
            c_sources["mpiabi"],
            depends=[
                *own["mpiabi"],
                str(FFI / "mpiabi_names.txt"),
                "conf/mpiabi_gen.py",
            ],
            language="c",
        ),
    ]


def jaxlib_include() -> str:
    """Return jaxlib's header directory (``jax.ffi.include_dir()``, without
    importing jax)."""
    try:
        import jaxlib
    except ImportError:
        raise SystemExit(
            "mpi4jax_dist: jaxlib is needed to build (XLA's FFI headers); install "
            "jax first, or let pip's build isolation install it."
        ) from None
    include = Path(jaxlib.__file__).resolve().parent / "include"
    if not (include / "xla" / "ffi" / "api" / "ffi.h").is_file():
        raise SystemExit(
            f"mpi4jax_dist: {include} holds no xla/ffi/api/ffi.h: this jaxlib has "
            f"no FFI headers. Install jax and jaxlib 0.6 or newer first."
        )
    return str(include)


def nanobind_paths() -> dict[str, str]:
    """Return nanobind's version, include directories and combined source."""
    try:
        import nanobind
    except ImportError:
        raise SystemExit(
            "mpi4jax_dist: nanobind is needed to build (the modules' Python "
            "bindings); pip install nanobind first, or let pip's build isolation "
            "install it."
        ) from None
    root = Path(nanobind.__file__).resolve().parent
    return {
        "version": nanobind.__version__,
        "include": nanobind.include_dir(),
        "robin_map": str(root / "ext" / "robin_map" / "include"),
        "source": str(Path(nanobind.source_dir()) / "nb_combined.cpp"),
    }


class BuildExt(build_ext):
    """build_ext that finds the MPI (and CUDA) when it runs, sets each module's
    flags, builds nanobind once for both modules, and writes the record."""

    def run(self):
        self._configure()
        lib = Path(self.build_lib, FFI)
        try:
            kept = json.loads((lib / RECORD).read_text())
        except (OSError, ValueError):
            kept = {}
        if kept.get("config") != self.record["config"]:
            self.force = True  # nothing kept is of this build's configuration
            if kept:
                print(f"mpi4jax_dist: {lib} holds another configuration's build")
        source = Path(self.get_finalized_command("build_py").get_package_dir(PACKAGE))
        for directory in [lib, source] if self.inplace else [lib]:
            self._remove_strays(directory)
        super().run()  # into build_lib; setuptools copies in place when editable
        for directory in [lib, source] if self.inplace else [lib]:
            directory.mkdir(parents=True, exist_ok=True)
            (directory / RECORD).write_text(json.dumps(self.record, indent=1) + "\n")

    def _configure(self):
        mpicc = mpiconfig.find_mpicc()
        compile_args, link_args = mpiconfig.split_flags(mpiconfig.mpicc_flags(mpicc))
        family = mpiconfig.mpi_family(compile_args)
        cuda, why = cudaconfig.find_cuda()
        self.nanobind = nanobind_paths()
        cxx = ["-std=c++17", "-O2", "-fvisibility=hidden", "-Wall", "-Wextra"]
        # XLA's and nanobind's headers, like CUDA's, are not ours to keep
        # warning-free.
        cxx += ["-isystem", jaxlib_include(), "-isystem", self.nanobind["include"]]
        print(f"mpi4jax_dist: building _cpu for {family} with {mpicc}", file=sys.stderr)
        if cuda is None:
            print(f"mpi4jax_dist: not building _cuda: {why}", file=sys.stderr)
            self.extensions = [
                e for e in self.extensions if not e.name.endswith("._cuda")
            ]
        else:
            print(f"mpi4jax_dist: building _cuda with {why}", file=sys.stderr)
        # The MPI's -I directories before those build_ext adds (Python's, and a
        # virtual environment's include/, where an MPI wheel keeps its mpi.h).
        includes = [flag[2:] for flag in compile_args if flag.startswith("-I")]
        others = [flag for flag in compile_args if not flag.startswith("-I")]
        for ext in self.extensions:
            kind = ext.name.rpartition("._")[2]
            ext.define_macros = list(MACROS)
            ext.include_dirs = list(includes)
            if kind == "mpiabi":
                ext.extra_compile_args = ["-O2", "-fvisibility=hidden", "-Wall"]
                ext.extra_compile_args += ["-Wextra", *others]
                # Everything resolved at link time: MPI, libdl and libc, never Python.
                ext.extra_link_args = [*link_args, "-ldl", "-Wl,--no-undefined"]
                continue
            if kind == "stacks":
                # Its sources share names (stacks.h) that are the module's alone.
                ext.extra_compile_args = ["-O2", "-fvisibility=hidden", "-Wall"]
                ext.extra_compile_args += ["-Wextra", *others]
                ext.extra_link_args = [*link_args, "-lpthread"]
                continue
            ext.extra_compile_args = [*cxx, *others]
            ext.extra_link_args = [*link_args, "-Wl,--gc-sections"]
            if kind == "cuda":
                ext.extra_compile_args[len(cxx) : len(cxx)] = [
                    flag for d in cuda["include"] for flag in ("-isystem", d)
                ]
                if "static" in cuda:
                    # The static runtime needs these system libraries (as nvcc
                    # links them).
                    ext.extra_objects = [str(cuda["static"])]
                    ext.extra_link_args += ["-ldl", "-lrt", "-lpthread"]
                else:
                    # By path (it may have no unversioned name), found at run time
                    # through the rpath.
                    ext.extra_objects = [str(cuda["shared"])]
                    ext.extra_link_args.append(f"-Wl,-rpath,{cuda['shared'].parent}")
        config = {"mpicc": mpicc, "compile": compile_args, "link": link_args}
        config.update(cxx=cxx, cuda=why if cuda else None, python=sys.version)
        config["nanobind"] = self.nanobind["version"]
        config["jaxlib"] = importlib.metadata.version("jaxlib")
        self.record = {
            "family": family,
            "modules": {
                ext.name.rpartition("._")[2]: Path(self.get_ext_filename(ext.name)).name
                for ext in self.extensions
            },
            "config": config,
        }

    def _remove_strays(self, directory: Path):
        """Remove the modules in ``directory`` that this build does not make: a
        ``_cuda`` built before for this Python, modules named per MPI family by
        older builds."""
        wanted = self.record["modules"].values()
        for path in sorted(directory.glob("_*")):
            ours = path.name in (f"_{kind}{SUFFIX}" for kind in KINDS)
            if (ours or FAMILY_NAMED.fullmatch(path.name)) and path.name not in wanted:
                print(f"mpi4jax_dist: removing {path} (not part of this build)")
                path.unlink()

    def _build_nanobind(self):
        """Compile nanobind's library once, with its own flags, for the modules to
        link (where a kept build directory lacks it, or it is older)."""
        out = os.path.join(self.build_temp, "nanobind")
        source = self.nanobind["source"]
        (self.nanobind_object,) = self.compiler.object_filenames(
            [source], output_dir=out
        )
        if (
            self.force
            or not os.path.isfile(self.nanobind_object)
            or os.path.getmtime(self.nanobind_object) < os.path.getmtime(source)
        ):
            flags = [*NANOBIND_FLAGS, "-isystem", self.nanobind["include"]]
            flags += ["-isystem", self.nanobind["robin_map"]]
            self.compiler.compile([source], output_dir=out, extra_postargs=flags)

    def build_extensions(self):
        if any(ext.language == "c++" for ext in self.extensions):
            # Once, before the modules (which build_ext -j builds in parallel).
            self._build_nanobind()
        super().build_extensions()

    def build_extension(self, ext):
        if ext.language == "c++":
            if self.nanobind_object not in ext.extra_objects:
                ext.extra_objects = [self.nanobind_object, *ext.extra_objects]
        elif ext.name.endswith("._mpiabi"):
            # The wrapper's generated constants and stubs, written into the build
            # directory (never into the source tree) and compiled as a source of
            # their own, against mpiabi.h.
            generated = os.path.abspath(os.path.join(self.build_temp, "mpiabi"))
            try:
                path = str(mpiabi_gen.write(generated))
            except ValueError as err:
                raise SystemExit(f"mpi4jax_dist: {err}") from None
            if path not in ext.sources:
                ext.sources = [*ext.sources, path]
            ffi = os.path.abspath(FFI)
            if ffi not in ext.include_dirs:
                ext.include_dirs.append(ffi)
        super().build_extension(ext)

    def get_outputs(self):
        return [*super().get_outputs(), str(Path(self.build_lib, FFI, RECORD))]

    def get_output_mapping(self):
        mapping = super().get_output_mapping()
        if self.inplace:
            source = self.get_finalized_command("build_py").get_package_dir(PACKAGE)
            mapping[str(Path(self.build_lib, FFI, RECORD))] = str(Path(source, RECORD))
        return mapping
