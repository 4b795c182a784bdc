"""Declare mpi4jax_dist's compiled part and build it against mpi4py's MPI.

One build per install, as mpi4jax builds its bridge, into ``mpi4jax_dist/_ffi``:

- ``_core``: not a Python module but a shared library, the state a process must
  have one of (the communicator registry, the record of calls, the agreement of
  the ranks, the collective timeout, the counts, the MPI lock) and the allreduces
  over host memory (``SOURCES["core"]``, declared in their headers), which both
  modules link (below, by ``SOURCES``, why);
- ``_cpu``: the CPU handlers and the Python module that hands them to JAX
  (``cpu.cc``, bound with nanobind);
- ``_cuda``: the CUDA handler (``cuda.cc``, ``cuda_staging.cc``), where a CUDA
  runtime is found (:mod:`cudaconfig`): a module of its own, so that ``_cpu``
  never needs CUDA;
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
KINDS = ("core", "cpu", "cuda", "stacks", "mpiabi")
# Each one's sources in mpi4jax_dist/_ffi. The core is what a process must have
# one of (the communicator registry, the record of calls, the agreement of the
# ranks, the collective timeout, the counts, the MPI lock) and the allreduces
# over host memory; the modules hold their handlers and bindings. COMMON, the
# bindings both modules define alike, is compiled once and linked into both, as
# nanobind's library is (it holds no state).
#
# Why the core is a shared library of its own: Python loads each extension
# with RTLD_LOCAL, so state compiled into both modules is two states in a
# process that loads both (two registries, records, MPI locks). A library that
# both link, named by its soname and found beside them through RUNPATH $ORIGIN,
# is loaded once by the dynamic linker, whichever module comes first. Unlike a
# table of function pointers in a PyCapsule (numpy's C API), it needs no Python
# to reach (XLA's handlers and _stacks's thread call it without the GIL) and no
# table to keep in step with the headers; unlike _cuda linking _cpu, neither
# module carries the other's handlers. The modules and the core always sit in
# one folder (an in-place or editable build, a wheel, an sdist's build, a
# copy-install), and jaxlib's FFI registration takes the handlers' addresses
# from the modules' capsules as before: those handlers call the one core.
SOURCES = {
    "core": [
        "agreement.cc",
        "allreduce.cc",
        "comm_registry.cc",
        "iallreduce.cc",
        "mpi_base.cc",
        "mpi_guard.cc",
        "op_dtype.cc",
        "record.cc",
        "request_table.cc",
        "stats.cc",
        "timeline.cc",
        "timeout.cc",
    ],
    "cpu": ["cpu.cc"],
    "cuda": ["cuda.cc", "cuda_staging.cc"],
    "stacks": [
        "stacks.c",
        "stacks_answer.c",
        "stacks_status.c",
        "stacks_dump.c",
        "stacks_interrupt.c",
        "stacks_sources.c",
        "stacks_text.c",
    ],
    # With mpiabi_generated.c, which mpiabi_gen writes at build time.
    "mpiabi": ["mpiabi.c", "mpiabi_record.c", "mpiabi_world.c"],
}
COMMON = "module_common.cc"
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
    # The C modules' headers are named for them (stacks.h, mpiabi.h); the others
    # are the C++ core's and modules'.
    own = {
        kind: [h for h in headers if re.match(rf"{kind}[._]", Path(h).name)]
        for kind in ("stacks", "mpiabi")
    }
    cc_headers = [h for h in headers if h not in own["stacks"] + own["mpiabi"]]
    depends = {
        "core": cc_headers,
        "cpu": [*cc_headers, str(FFI / COMMON)],
        "cuda": [*cc_headers, str(FFI / COMMON)],
        "stacks": own["stacks"],
        "mpiabi": [*own["mpiabi"], str(FFI / "mpiabi_names.txt"), "conf/mpiabi_gen.py"],
    }
    return [
        Extension(
            f"{PACKAGE}._{kind}",
            [str(FFI / name) for name in SOURCES[kind]],
            depends=depends[kind],
            language="c" if kind in ("stacks", "mpiabi") else "c++",
        )
        for kind in KINDS
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
            if kind == "core":
                # Named by its file (its soname) in the modules that link it,
                # which find it beside them ($ORIGIN); everything resolved at
                # link time (MPI, C++'s library), never Python.
                ext.define_macros.append(("MPI4JAX_DIST_BUILDING_CORE", "1"))
                name = Path(self.get_ext_filename(ext.name)).name
                ext.extra_link_args = [*link_args, f"-Wl,-soname,{name}"]
                ext.extra_link_args += ["-Wl,--no-undefined"]
                continue
            ext.extra_link_args = [*link_args, "-Wl,--gc-sections"]
            ext.extra_link_args.append("-Wl,-rpath,$ORIGIN")
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
        # module_common.cc's flags: the modules' own (CUDA's headers aside).
        self.common_flags = [*cxx, *others]
        self.common_includes = list(includes)
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

    def _build_shared_objects(self):
        """Compile what both modules link once, each with its own flags:
        nanobind's library (where a kept build directory lacks it, or it is
        older) and the bindings they define alike (``module_common.cc``)."""
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
        (self.common_object,) = self.compiler.compile(
            [str(FFI / COMMON)],
            output_dir=os.path.join(self.build_temp, "common"),
            macros=list(MACROS),
            include_dirs=self.common_includes,
            extra_postargs=self.common_flags,
            depends=next(e for e in self.extensions if e.language == "c++").depends,
        )

    def build_extensions(self):
        modules = [e for e in self.extensions if e.language == "c++"]
        core = [e for e in modules if e.name.endswith("._core")]
        if modules:
            # Once, before the modules (which build_ext -j builds in parallel).
            self._build_shared_objects()
        # The core first: the modules link it.
        for ext in core:
            self.build_extension(ext)
        self.core_library = (
            os.path.abspath(self.get_ext_fullpath(core[0].name)) if core else None
        )
        everything, self.extensions = self.extensions, [
            e for e in self.extensions if e not in core
        ]
        try:
            super().build_extensions()
        finally:
            self.extensions = everything

    def build_extension(self, ext):
        if ext.language == "c++" and not ext.name.endswith("._core"):
            # The bindings and nanobind, compiled once, and the core, linked by
            # its soname and found beside the module ($ORIGIN).
            shared = [self.common_object, self.nanobind_object, self.core_library]
            ext.extra_objects = [
                *shared,
                *(o for o in ext.extra_objects if o not in shared),
            ]
        elif ext.name.endswith("._core"):
            # One translation unit of the core's sources, written into the build
            # directory: each includes XLA's FFI header (by mpi_base.h), whose
            # parse is most of a source's compile (2-4 s each, 11 sources), and
            # one unit pays it once (39 s of compile to 10.5 on a busy 2-core
            # machine, 2026-12-06). Errors and warnings still name the source
            # and line.
            ext.sources = [self._core_unit(ext)]
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

    def _core_unit(self, ext) -> str:
        """``core_unit.cc`` in the build directory, which includes the core's
        sources in order; written only when it changes, so that a kept build
        stays kept. The sources join the extension's dependencies."""
        sources = [str((ROOT / FFI / n).resolve()) for n in SOURCES["core"]]
        text = "// Written by conf/builder.py: the core as one unit.\n"
        text += "".join(f'#include "{source}"\n' for source in sources)
        path = Path(os.path.abspath(self.build_temp), "core_unit.cc")
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.is_file() or path.read_text() != text:
            path.write_text(text)
        for source in sources:
            if source not in ext.depends:
                ext.depends.append(source)
        return str(path)

    def get_outputs(self):
        return [*super().get_outputs(), str(Path(self.build_lib, FFI, RECORD))]

    def get_output_mapping(self):
        mapping = super().get_output_mapping()
        if self.inplace:
            source = self.get_finalized_command("build_py").get_package_dir(PACKAGE)
            mapping[str(Path(self.build_lib, FFI, RECORD))] = str(Path(source, RECORD))
        return mapping
