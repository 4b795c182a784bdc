"""Serial: which MPI compiler wrapper the build (conf/mpiconfig.py) uses, and how it
learns the wrapper's flags, with stand-in wrappers around the running environment's MPI
(nothing of MPI mocked: the stand-ins print what the real wrapper prints).

``$MPICC`` (mpi4py's variable) wins over every mpicc found, and set to nothing
runnable fails the build rather than falling back to another MPI; with Cray's
Programming Environment loaded and no mpicc anywhere, Cray's ``cc`` is used, its
flags taken from ``--cray-print-opts``. The last test builds the extension with
the stand-in ``cc`` from a copy of the sources, in an environment without mpicc
(about 7 s on this project's 2-core machine).
"""

from __future__ import annotations

import importlib.machinery
import json
import os
import shlex
import shutil
import stat
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import util

pytestmark = util.serial_only

REAL_MPICC = Path(sys.prefix) / "bin" / "mpicc"
# Marks the flags each stand-in adds to the real wrapper's: where they show, that
# stand-in's flags were used.
MPICC_MARK = "-DMPI4JAX_DIST_TEST_MY_MPICC=1"
CRAY_MARK = "-DMPI4JAX_DIST_TEST_CRAY_CC=1"
# Variables that choose the wrapper: set only where a test is about them.
CHOOSING = ("MPICC", "MPI4PY_BUILD_MPICC", "PE_ENV", "CRAYPE_VERSION")


@pytest.fixture(scope="module")
def mpiconfig():
    return util.load_conf("mpiconfig")


@pytest.fixture(scope="module")
def real(mpiconfig):
    """The running environment's own wrapper, its flags and its compiler."""
    if not REAL_MPICC.is_file():
        pytest.skip(f"no {REAL_MPICC}: the stand-ins wrap the environment's mpicc")
    flags = mpiconfig.mpicc_flags(str(REAL_MPICC))
    compile_args, link_args = mpiconfig.split_flags(flags)
    out = subprocess.run(
        [str(REAL_MPICC), "-show"], capture_output=True, text=True, timeout=60
    )
    if out.returncode != 0:  # Open MPI's
        out = subprocess.run(
            [str(REAL_MPICC), "--showme"], capture_output=True, text=True, timeout=60
        )
    compiler = shutil.which(shlex.split(out.stdout)[0])
    assert compiler, out.stdout
    return {
        "flags": flags,
        "compile": compile_args,
        "link": link_args,
        "compiler": compiler,
        "family": mpiconfig.mpi_family(compile_args),
    }


def _script(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n" + text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory, real) -> dict[str, Path]:
    """``my-mpicc``: the real wrapper, whose -show (or --showme) adds MPICC_MARK;
    ``cc``: Cray's wrapper as it looks from outside, answering
    ``--cray-print-opts=cflags`` and ``=libs`` with the real wrapper's compile and
    link flags (and CRAY_MARK), and passing anything else to the compiler beneath
    (so ``-show`` fails, as with Cray's)."""
    tmp = tmp_path_factory.mktemp("wrappers")
    mpicc = shlex.quote(str(REAL_MPICC))
    my_mpicc = _script(
        tmp / "named" / "my-mpicc",
        f"""case "$1" in
    -show|--showme) out=$({mpicc} "$1") || exit $?; echo "$out {MPICC_MARK}" ;;
    *) exec {mpicc} "$@" ;;
esac
""",
    )
    cflags = shlex.join([*real["compile"], CRAY_MARK])
    libs = shlex.join(real["link"])
    cc = _script(
        tmp / "cray" / "cc",
        f"""case "$1" in
    --cray-print-opts=cflags) echo {shlex.quote(cflags)} ;;
    --cray-print-opts=libs) echo {shlex.quote(libs)} ;;
    --cray-print-opts=all) echo {shlex.quote(cflags + " " + libs)} ;;
    --cray-print-opts*) echo "cc: unknown option $1" >&2; exit 1 ;;
    *) exec {shlex.quote(real["compiler"])} "$@" ;;
esac
""",
    )
    # A plain compiler named cc: not Cray's.
    plain = tmp / "plain" / "cc"
    plain.parent.mkdir()
    plain.symlink_to(real["compiler"])
    return {"my-mpicc": my_mpicc, "cc": cc, "plain": plain}


def _path_without_mpicc(*first: Path, masks: Path | None = None) -> str:
    """PATH with ``first`` before it and no mpicc: a folder that holds one is left
    out, or, with ``masks``, stands in as a folder there of links to its other
    commands (a command to run needs /usr/bin's g++ and the like, where a
    system MPI puts its mpicc)."""
    dirs = []
    for d in (d for d in os.environ["PATH"].split(os.pathsep) if d):
        if not (Path(d) / "mpicc").exists():
            dirs.append(d)
        elif masks is not None:
            mask = masks / str(len(dirs))
            mask.mkdir(parents=True)
            for entry in Path(d).iterdir():
                if entry.name != "mpicc":
                    (mask / entry.name).symlink_to(entry)
            dirs.append(str(mask))
    return os.pathsep.join([*map(str, first), *dirs])


@pytest.fixture
def no_mpi4py_mpicc(monkeypatch):
    """mpi4py built without a configured mpicc (as its wheels are): the build
    then looks no further than PATH and Cray's cc."""
    import mpi4py

    monkeypatch.setattr(mpi4py, "get_config", dict)


def test_mpicc_wins_over_every_mpicc_found(mpiconfig, real, stand_ins):
    """MPICC, a path or a command on PATH, comes before the environment's own
    mpicc (sys.prefix/bin, first on PATH too); MPI4PY_BUILD_MPICC before MPICC,
    as in mpi4py. Its -show's flags are those used."""
    my_mpicc = stand_ins["my-mpicc"]
    path = os.pathsep.join([str(REAL_MPICC.parent), os.environ["PATH"]])
    env = {"PATH": path, "MPICC": str(my_mpicc)}
    assert mpiconfig.find_mpicc(env, sys.prefix) == str(my_mpicc)
    env = {"PATH": f"{my_mpicc.parent}{os.pathsep}{path}", "MPICC": "my-mpicc"}
    assert mpiconfig.find_mpicc(env, sys.prefix) == str(my_mpicc)
    env = {"PATH": path, "MPICC": str(REAL_MPICC), "MPI4PY_BUILD_MPICC": str(my_mpicc)}
    assert mpiconfig.find_mpicc(env, sys.prefix) == str(my_mpicc)
    # With arguments, as mpi4py allows (MPICC="cc -shared"): the wrapper alone.
    env = {"PATH": path, "MPICC": f"{my_mpicc} -shared"}
    assert mpiconfig.find_mpicc(env, sys.prefix) == str(my_mpicc)
    # Unset, or set to nothing: the environment's own.
    assert mpiconfig.find_mpicc({"PATH": path, "MPICC": ""}, sys.prefix) == str(
        REAL_MPICC
    )

    flags = mpiconfig.mpicc_flags(str(my_mpicc))
    assert flags == [*real["flags"], MPICC_MARK]
    compile_args, link_args = mpiconfig.split_flags(flags)
    assert compile_args == [*real["compile"], MPICC_MARK]
    assert link_args == real["link"]
    assert mpiconfig.mpi_family(compile_args) == real["family"]


@pytest.mark.parametrize(
    "value, why",
    [
        ("no-such-mpicc-4jax", "not found on PATH"),
        ("/no/such/dir/mpicc", "no such file"),
        ("no-such-mpicc-4jax -shared", "no-such-mpicc-4jax: not found on PATH"),
        ("/no/such/dir/mpicc -shared", "/no/such/dir/mpicc: no such file"),
        ("NOT_EXECUTABLE", "not executable"),
    ],
)
def test_mpicc_naming_nothing_runnable_fails(mpiconfig, tmp_path, value, why):
    """Set, MPICC is what the user wants: not found, the build stops naming the
    variable, its value and the fix, though an mpicc is at hand."""
    if value == "NOT_EXECUTABLE":
        value = str(tmp_path / "mpicc")
        Path(value).write_text("#!/bin/sh\n")
    env = {"PATH": f"{REAL_MPICC.parent}{os.pathsep}{os.environ['PATH']}"}
    for name in ("MPICC", "MPI4PY_BUILD_MPICC"):
        with pytest.raises(SystemExit) as raised:
            mpiconfig.find_mpicc({**env, name: value}, sys.prefix)
        message = str(raised.value)
        assert message == (
            f"mpi4jax_dist: {name}={value!r} names no MPI compiler wrapper ({why}). "
            f"Set {name} to your MPI's C compiler wrapper, as a command on PATH "
            "(mpicc; cc under Cray's Programming Environment) or its full path, "
            f"or unset {name} to let the build look for mpicc."
        )


def test_cray_cc_without_any_mpicc(
    mpiconfig, real, stand_ins, tmp_path, no_mpi4py_mpicc
):
    """Cray's Programming Environment loaded (PE_ENV, or CRAYPE_VERSION alone) and
    no mpicc anywhere: Cray's cc, whose --cray-print-opts flags are used (all of
    them: no compiler named first to drop), split into compile and link flags."""
    cc = stand_ins["cc"]
    path = _path_without_mpicc(cc.parent)
    prefix = tmp_path / "env"  # no bin/mpicc
    for cray in ({"PE_ENV": "GNU"}, {"CRAYPE_VERSION": "2.7.30"}):
        assert mpiconfig.find_mpicc({"PATH": path, **cray}, prefix) == str(cc)
    # Asked for -show and --showme first, it fails them, as Cray's does.
    for option in ("-show", "--showme"):
        out = subprocess.run([str(cc), option], capture_output=True, timeout=60)
        assert out.returncode != 0
    flags = mpiconfig.mpicc_flags(str(cc))
    assert flags == [*real["compile"], CRAY_MARK, *real["link"]]
    compile_args, link_args = mpiconfig.split_flags(flags)
    assert compile_args == [*real["compile"], CRAY_MARK]
    assert link_args == real["link"]
    assert mpiconfig.mpi_family(compile_args) == real["family"]
    # An mpicc on PATH still comes first (the order of the module docstring).
    on_path = os.pathsep.join([str(REAL_MPICC.parent), path])
    assert mpiconfig.find_mpicc({"PATH": on_path, "PE_ENV": "GNU"}, prefix) == str(
        REAL_MPICC
    )


def test_no_wrapper_found_says_mpicc_and_cray(
    mpiconfig, stand_ins, tmp_path, no_mpi4py_mpicc
):
    """No mpicc, and Cray's cc not used: without Cray's environment (the stand-in
    cc on PATH is not asked), or with it and a cc that is a plain compiler."""
    prefix = tmp_path / "env"
    common = (
        "mpi4jax_dist: no MPI compiler wrapper found: MPICC is not set, and there "
        f"is no mpicc in this environment ({prefix / 'bin'}), in mpi4py's "
        "configuration, or on PATH. Install an MPI first (pip install mpich, or "
        "your system's MPI with its development files) and put its mpicc on PATH, "
        "or name its wrapper: MPICC=/path/to/mpicc pip install ... (mpi4py's "
        "variable)."
    )
    env = {"PATH": _path_without_mpicc(stand_ins["cc"].parent)}
    with pytest.raises(SystemExit) as raised:
        mpiconfig.find_mpicc(env, prefix)
    assert str(raised.value) == common + (
        " On a Cray system, load a PrgEnv-* module and cray-mpich: Cray's cc is "
        "then used."
    )
    plain = stand_ins["plain"]
    env = {"PATH": _path_without_mpicc(plain.parent), "PE_ENV": "GNU"}
    with pytest.raises(SystemExit) as raised:
        mpiconfig.find_mpicc(env, prefix)
    assert str(raised.value) == common + (
        " Cray's Programming Environment is loaded (PE_ENV=GNU), but "
        f"{plain} does not answer --cray-print-opts: load a PrgEnv-* module and "
        "cray-mpich."
    )
    with pytest.raises(SystemExit, match="--cray-print-opts=cflags and =libs"):
        mpiconfig.mpicc_flags(str(plain))


def _copy_sources(source: Path):
    """What build_ext needs of the tree, without any build in it."""
    for name in ("setup.py", "setup.cfg", "pyproject.toml", "README.rst", "LICENSE"):
        shutil.copy2(util.ROOT / name, source / name)
    for name in ("mpi4jax_dist", "conf"):
        shutil.copytree(
            util.ROOT / name,
            source / name,
            ignore=shutil.ignore_patterns("*.so", "_build.*.json", "__pycache__"),
        )


# Loads the built module by path (importing the package would import jax): its
# MPI resolves, and it says which mpi.h it was compiled against.
LOAD_BUILT = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location(sys.argv[1], sys.argv[2])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
print(module.HEADER_MPI)
"""


def test_build_with_cray_cc(real, stand_ins, tmp_path):
    """``python setup.py build_ext`` from a copy of the sources, run by a Python
    environment without mpicc (this one's packages, its bin/ left out), with no
    mpicc on PATH and Cray's environment loaded: built with the stand-in cc's
    flags, into _cpu (for MPICH's family, for Cray MPICH), and the module loads.
    What a kept build directory holds of another MPI is built again or removed."""
    env_root = tmp_path / "env"
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(env_root)],
        check=True,
        timeout=120,
    )
    python = env_root / "bin" / "python"
    assert not (env_root / "bin" / "mpicc").exists()
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.strip()
    ours = dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))
    (Path(site) / "running_env.pth").write_text(
        "".join(f"import site; site.addsitedir({p!r})\n" for p in ours)
    )
    source, lib, temp = tmp_path / "source", tmp_path / "lib", tmp_path / "temp"
    source.mkdir()
    _copy_sources(source)
    env = util.clean_env(
        PATH=_path_without_mpicc(stand_ins["cc"].parent, masks=tmp_path / "masks"),
        PE_ENV="GNU",
        MPI4JAX_DIST_BUILD_CUDA="0",
    )
    for name in CHOOSING[:2]:
        env.pop(name, None)
    # A build directory kept from a build against another MPI: its module, newer
    # than the sources, is built again (not shipped as up to date), and a module
    # named per MPI family by an older build goes.
    family = real["family"]
    ffi = lib / "mpi4jax_dist" / "_ffi"
    ffi.mkdir(parents=True)
    other = "openmpi" if family != "openmpi" else "mpich"
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    stale = ffi / f"_cpu_{other}{suffix}"
    stale.write_bytes(b"")
    (ffi / f"_cpu{suffix}").write_bytes(b"")
    record = ffi / f"_build{suffix.removesuffix('.so')}.json"
    record.write_text(json.dumps({"family": other, "config": {}}))
    cmd = [str(python), "setup.py", "build_ext", "--build-lib", str(lib)]
    cmd += ["--build-temp", str(temp)]
    proc = util.run_command(cmd, env=env, timeout=600, cwd=source)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    assert not stale.exists() and f"removing {stale}" in output, output
    assert f"building _cpu for {family} with {stand_ins['cc']}" in output, output
    assert f"{ffi} holds another configuration's build" in output, output
    assert CRAY_MARK in output  # on the compilers' command lines
    cpu = ffi / f"_cpu{suffix}"
    assert cpu.stat().st_size > 0, "the kept module was shipped as up to date"
    assert (ffi / f"_mpiabi{suffix}").is_file(), sorted(ffi.iterdir())
    built = json.loads(record.read_text())
    assert built["family"] == family, built
    assert built["modules"] == {
        "core": f"_core{suffix}",
        "cpu": cpu.name,
        "stacks": f"_stacks{suffix}",
        "mpiabi": f"_mpiabi{suffix}",
    }
    assert not (source / "build").exists()
    loaded = util.run_command(
        [
            sys.executable,
            "-c",
            LOAD_BUILT,
            "mpi4jax_dist._ffi._cpu",
            str(cpu),
        ],
        env=util.clean_env(),
        timeout=60,
    )
    assert loaded.returncode == 0, loaded.stdout + loaded.stderr
    assert loaded.stdout.strip(), loaded.stdout
