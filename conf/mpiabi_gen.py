"""Generate the MPIABI wrapper's constants and stubs from ``mpiabi_names.txt``.

jaxlib's MPItrampoline resolves several hundred names in the wrapper library
(``mpi4jax_dist/_ffi/mpiabi.c``, built into ``_mpiabi``). Most of them are
constants and functions XLA never uses; this module writes them, so that
``mpiabi.c`` holds only the hand-written functions. The build (conf/builder.py)
runs it and writes the result into the build directory as ``mpiabi_generated.c``,
a source of the library of its own, compiled beside ``mpiabi.c``: nothing
generated is committed, and the name list beside ``mpiabi.c`` is the one source of
truth.

What it writes, for the native MPI whose ``mpi.h`` it includes (with the wrapper's
``mpiabi.h``):

- a definition of each constant ``MPIABI_<NAME>`` of its ABI type, and
  ``mpiabi_set_constants()``, which ``mpiabi.c`` runs when the library loads (before
  MPItrampoline reads them), giving each the native value cast to the ABI type;
  ``optional`` ones behind ``#ifdef``, with the null of their type where absent;
- ``mpi4jax_dist_mpiabi_absent``, the names of the constants this MPI lacked
  (space-separated, empty if none): a string the library exports for diagnostics;
- ``mpiabi_xla_calls``, the names of the functions XLA calls, for the stubs'
  message;
- a stub ``MPIABI_<Name>`` for every function ``mpiabi.c`` does not define, which
  says so on stderr and aborts (``mpiabi_not_implemented`` in ``mpiabi.c``).

Stdlib only. Run as a script to see the output: ``python conf/mpiabi_gen.py [OUT]``.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path

# The wrapper's C source and its name list, in the package.
FFI = Path(__file__).resolve().parent.parent / "mpi4jax_dist" / "_ffi"
NAMES = FFI / "mpiabi_names.txt"
SOURCE = FFI / "mpiabi.c"
GENERATED = "mpiabi_generated.c"

# The handle types and their classes' null handles.
HANDLES = {
    "MPIABI_Comm": "MPI_COMM_NULL",
    "MPIABI_Datatype": "MPI_DATATYPE_NULL",
    "MPIABI_Errhandler": "MPI_ERRHANDLER_NULL",
    "MPIABI_File": "MPI_FILE_NULL",
    "MPIABI_Group": "MPI_GROUP_NULL",
    "MPIABI_Info": "MPI_INFO_NULL",
    "MPIABI_Message": "MPI_MESSAGE_NULL",
    "MPIABI_Op": "MPI_OP_NULL",
    "MPIABI_Request": "MPI_REQUEST_NULL",
    "MPIABI_Win": "MPI_WIN_NULL",
}
INTEGERS = ("int", "MPIABI_Offset")
POINTERS = ("void*", "int*", "char**", "char***", "MPIABI_Fint*", "MPIABI_Status*")
# Pointers to callbacks: MPIABI_Comm_copy_attr_function*, MPIABI_Copy_function*, ...
CALLBACK = re.compile(r"MPIABI_\w*_function\*")

# A hand-written function in mpiabi.c: "MPIABI_API <type> MPIABI_<Name>(" (or
# MPIXABI_<Name>, for the MPIX_ extensions) at the start of a line; the macro marks
# what the library exports.
DEFINITION = re.compile(
    r"^MPIABI_API\s+[\w\s\*]*?\b(MPIX?ABI_[A-Z][a-z]\w*)\s*\(", re.MULTILINE
)


def abi_name(name: str) -> str:
    """The ABI's name for an MPI name: MPI_X -> MPIABI_X, MPIX_X -> MPIXABI_X."""
    return re.sub(r"^MPI(X?)_", r"MPI\1ABI_", name)


def mpi_name(name: str) -> str:
    """The MPI name for an ABI name (the inverse of :func:`abi_name`)."""
    return re.sub(r"^MPI(X?)ABI_", r"MPI\1_", name)


@dataclass(frozen=True)
class Constant:
    abi_type: str  # as in the name list, without spaces: "int", "MPIABI_Status*"
    name: str  # the MPI name, "MPI_COMM_WORLD"
    optional: bool

    @property
    def abi_name(self) -> str:
        return abi_name(self.name)

    @property
    def c_type(self) -> str:
        return re.sub(r"(\*+)$", r" \1", self.abi_type)

    def cast(self, expression: str) -> str:
        if CALLBACK.fullmatch(self.abi_type):
            # Through a generic function pointer: the native callback types take
            # native handles, and GCC's -Wcast-function-type exempts void (*)(void).
            return f"({self.c_type})(void (*)(void))({expression})"
        return f"({self.c_type})({expression})"

    def null(self) -> str:
        if self.abi_type in HANDLES:
            return self.cast(HANDLES[self.abi_type])
        if self.abi_type in INTEGERS:
            return self.cast("MPI_UNDEFINED")
        return self.cast("NULL")


@dataclass(frozen=True)
class Function:
    name: str  # "MPI_Allreduce", "MPIX_Query_cuda_support"
    xla: bool  # XLA's MPI collectives call it

    @property
    def abi_name(self) -> str:
        return abi_name(self.name)


def parse(text: str) -> tuple[list[Constant], list[Function]]:
    """Return the constants and functions of a name list (``mpiabi_names.txt``).

    Raises:
        ValueError: a line that is not a constant or a function of the list's
            format, an unknown ABI type, or a name listed twice.
    """
    constants, functions, seen = [], [], set()
    for number, line in enumerate(text.splitlines(), 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        where = f"mpiabi_names.txt line {number}: {line.strip()!r}"
        if words[0] == "const" and len(words) in (3, 4):
            _, abi_type, name, *flags = words
            known = (
                abi_type in HANDLES
                or abi_type in INTEGERS
                or abi_type in POINTERS
                or CALLBACK.fullmatch(abi_type)
            )
            if not known:
                raise ValueError(f"{where}: unknown ABI type {abi_type!r}")
            if flags not in ([], ["optional"]):
                raise ValueError(f"{where}: expected 'optional' or nothing at the end")
            item = Constant(abi_type, name, bool(flags))
            constants.append(item)
        elif words[0] == "function" and len(words) in (2, 3):
            _, name, *flags = words
            if flags not in ([], ["xla"]):
                raise ValueError(f"{where}: expected 'xla' or nothing at the end")
            item = Function(name, bool(flags))
            functions.append(item)
        else:
            raise ValueError(
                f"{where}: expected 'const <ABI type> MPI_<NAME> [optional]' or "
                f"'function MPI_<Name> [xla]'"
            )
        if not re.fullmatch(r"MPIX?_\w+", item.name):
            raise ValueError(f"{where}: {item.name!r} is not an MPI name")
        if item.name in seen:
            raise ValueError(f"{where}: {item.name} is listed twice")
        seen.add(item.name)
    return constants, functions


def implemented(source: str) -> set[str]:
    """Return the functions ``mpiabi.c`` defines, as MPI names (``MPI_Wait``)."""
    return {mpi_name(name) for name in DEFINITION.findall(source)}


def generate(names: str, source: str) -> str:
    """Return ``mpiabi_generated.c``, from the name list and ``mpiabi.c``.

    Raises:
        ValueError: the name list is malformed, ``mpiabi.c`` defines a function
            that is not in it, or does not define one that XLA calls.
    """
    constants, functions = parse(names)
    written = implemented(source)
    listed = {f.name for f in functions}
    unknown = sorted(written - listed)
    if unknown:
        raise ValueError(
            f"mpiabi.c defines {', '.join(unknown)}, which mpiabi_names.txt does "
            f"not list: MPItrampoline would never call it."
        )
    xla = [f.name for f in functions if f.xla]
    missing = sorted(set(xla) - written)
    if missing:
        raise ValueError(
            f"XLA calls {', '.join(missing)}, which mpiabi.c does not implement."
        )
    lines = [
        "/* Generated by conf/mpiabi_gen.py from mpi4jax_dist/_ffi/mpiabi_names.txt"
        " and the",
        " * functions mpiabi.c defines. Do not edit: it is rewritten at every"
        " build. */",
        "",
        "#include <mpi.h>",
        "",
        "#include <stddef.h>",
        "",
        '#include "mpiabi.h"',
        "",
        "/* Deprecated constants (MPI_DUP_FN, ...) are part of the ABI all the"
        " same. */",
        "#pragma GCC diagnostic push",
        '#pragma GCC diagnostic ignored "-Wdeprecated-declarations"',
        "",
        f"/* The {len(constants)} constants, set by mpiabi_set_constants(). */",
    ]
    for c in constants:
        lines.append(f"MPIABI_API {c.c_type} {c.abi_name};")
    lines += [
        "",
        "/* The optional constants this MPI lacks, space-separated. */",
        'MPIABI_API const char mpi4jax_dist_mpiabi_absent[] = ""',
    ]
    for c in constants:
        if c.optional:
            lines += [f"#ifndef {c.name}", f'    " {c.name}"', "#endif"]
    lines += [
        "    ;",
        "",
        "void mpiabi_set_constants(void) {",
    ]
    for c in constants:
        if c.optional:
            lines += [
                f"#ifdef {c.name}",
                f"  {c.abi_name} = {c.cast(c.name)};",
                "#else",
                f"  {c.abi_name} = {c.null()};",
                "#endif",
            ]
        else:
            lines.append(f"  {c.abi_name} = {c.cast(c.name)};")
    lines += ["}", ""]
    stubs = [f for f in functions if f.name not in written]
    xla_list = ", ".join(xla)
    lines.append(
        f"/* The {len(stubs)} functions mpiabi.c does not implement"
        f" ({len(functions) - len(stubs)} it does). */"
    )
    lines.append(f'const char mpiabi_xla_calls[] = "{xla_list}";')
    for f in stubs:
        lines += [
            f"MPIABI_API int {f.abi_name}(void) {{",
            f'  mpiabi_not_implemented("{f.name}");',
            "}",
        ]
    lines += ["", "#pragma GCC diagnostic pop", ""]
    return "\n".join(lines)


def write(directory: str | Path, names: Path = NAMES, source: Path = SOURCE) -> Path:
    """Write ``mpiabi_generated.c`` into ``directory``; return its path.

    The file is rewritten only when its text changes, so that an unchanged build
    stays up to date.
    """
    text = generate(names.read_text(), source.read_text())
    path = Path(directory) / GENERATED
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.is_file() or path.read_text() != text:
        path.write_text(text)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python conf/mpiabi_gen.py",
        description=f"Write the MPIABI wrapper's constants and stubs ({GENERATED}) "
        f"from {NAMES.name} and the functions {SOURCE.name} defines.",
    )
    parser.add_argument(
        "out",
        nargs="?",
        help=f"the directory to write {GENERATED} into (made if need be); "
        f"without it the source goes to stdout",
    )
    args = parser.parse_args(argv)
    if args.out is not None:
        print(write(args.out))
    else:
        sys.stdout.write(generate(NAMES.read_text(), SOURCE.read_text()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
