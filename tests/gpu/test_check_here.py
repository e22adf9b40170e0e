"""The GPU check, proved here on the CPU (issue 43): `make gpu-bundle` builds what the lent
host lacks, for its Python and CUDA, under 40 MiB, never carrying the host's own packages;
and scripts/gpu_check.sh runs end to end as a CPU dry run (``PDSERVE_CHECK_DEVICE=cpu``),
every step writing its result file. The dry run runs the check's default test list but for the
engine tests the suite itself runs on the CPU (SUITE_RUNS); that list is proved on its own, from
the script, in a second.

The bundle test downloads from PyPI, as `make gpu-bundle` does (about 70 MB, from pip's cache
after the first time)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import xml.etree.ElementTree as ET
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import gpu_bundle  # noqa: E402

pytestmark = pytest.mark.slow

# Libraries the host provides (the C runtime, CUDA's driver and runtime, NVML, OpenSSL 3, which
# etcd's client in libnixl links): a bundled file may link these and nothing else outside the
# bundle. The lent H100 host resolved every one of them in all four check runs (BENCHMARKS.md).
HOST_LIBRARIES = {"libc.so.6", "libm.so.6", "libdl.so.2", "libpthread.so.0", "librt.so.1",
                  "ld-linux-x86-64.so.2", "libstdc++.so.6", "libgcc_s.so.1", "libcuda.so.1",
                  "libcudart.so.13", "libnvidia-ml.so.1", "libz.so.1", "libssl.so.3", "libcrypto.so.3"}


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bundle") / "gpu_bundle"
    subprocess.run([sys.executable, str(ROOT / "scripts/gpu_bundle.py"), "--out", str(out)], check=True,
                   capture_output=True, text=True, timeout=600)
    return out


def test_the_bundle_is_under_its_limit(bundle):
    assert 0 < gpu_bundle.folder_bytes(bundle) < gpu_bundle.LIMIT_BYTES


def test_every_wheel_is_for_cpython_312_on_manylinux_x86_64_and_none_is_the_hosts(bundle):
    wheels = sorted((bundle / "wheels").glob("*.whl"))
    assert len(wheels) == len(gpu_bundle.GPU_WHEELS)
    for wheel in wheels:
        name, _version, python, abi, platform = wheel.stem.split("-")[:5]
        assert python in ("cp312", "py3", "cp310") and abi in ("cp312", "none", "abi3"), wheel.name
        assert platform == "any" or all(p.startswith("manylinux") and p.endswith("x86_64")
                                        for p in platform.split(".")), wheel.name
        assert name.lower().replace("_", "-") not in gpu_bundle.HOST_PACKAGES, wheel.name
        with zipfile.ZipFile(wheel) as zf:
            tops = {n.split("/")[0] for n in zf.namelist()}
        assert not tops & {"torch", "numpy", "transformers"}, (wheel.name, tops)


def test_the_nixl_subset_has_the_ucx_cuda_path_and_every_link_resolves_inside_it_or_on_the_host(bundle, tmp_path):
    with tarfile.open(bundle / gpu_bundle.NIXL_ARCHIVE) as tar:
        tar.extractall(tmp_path, filter="data")
        names = tar.getnames()
    for wanted in ("nixl_cu13/_api.py", ".nixl_cu13.mesonpy.libs/plugins/libplugin_UCX.so",
                   "nixl_cu13.libs/ucx/libuct_cuda.so.0.0.0"):
        assert wanted in names
    assert not any("nixl_ep" in n or "libplugin_OBJ" in n or "libaws" in n for n in names)  # left out
    shipped = {Path(n).name for n in names}
    for name in names:
        path = tmp_path / name
        if path.is_file() and (path.suffix == ".so" or ".so." in path.name):
            needed, _ = gpu_bundle.elf_links(path)
            assert set(needed) <= shipped | HOST_LIBRARIES, (name, set(needed) - shipped - HOST_LIBRARIES)


# Tests the check runs that the suite also runs here, on the CPU, in its own process: the dry
# run leaves them out (they would run twice); the check's default list must still name them.
SUITE_RUNS = ("tests/engine/test_one_sync.py", "tests/engine/test_triton_attention.py",
              "tests/engine/test_triton_split_kv.py", "tests/engine/test_triton_fused.py")


@pytest.fixture(scope="module")
def default_tests(tmp_path_factory) -> list[str]:
    """The tests scripts/gpu_check.sh runs with no GPU_CHECK_ONLY, in its order: the script run
    with a stand-in interpreter that records what it is asked to run under pytest (and no more)."""
    tmp = tmp_path_factory.mktemp("default-list")
    record, stand_in = tmp / "args", tmp / "python"
    stand_in.write_text(f'#!/bin/sh\nif [ "$1 $2" = "-m pytest" ]; then printf "%s\\n" "$@" > {record}; fi\n')
    stand_in.chmod(0o755)
    env = {**os.environ, "PYTHON": str(stand_in), "GPU_BUNDLE": str(tmp / "none"), "GPU_CHECK_OUT": str(tmp / "out")}
    env.pop("GPU_CHECK_ONLY", None)
    subprocess.run(["bash", str(ROOT / "scripts/gpu_check.sh")], env=env, check=True, capture_output=True,
                   text=True, timeout=120)
    return [a for a in record.read_text().splitlines() if a.startswith("tests/")]


def test_the_checks_default_list_is_every_device_test_and_each_file_exists(default_tests):
    device = {f"tests/gpu/{p.name}" for p in (ROOT / "tests/gpu").glob("test_*.py")} - {"tests/gpu/test_check_here.py"}
    assert len(default_tests) == len(set(default_tests)), default_tests
    assert set(default_tests) == device | set(SUITE_RUNS), default_tests
    assert all((ROOT / name).is_file() for name in default_tests), default_tests


def test_the_whole_check_dry_runs_on_the_cpu(tmp_path, default_tests):
    """Every step of scripts/gpu_check.sh on the CPU, with a 2-layer model: it proves the
    check (its tests, its result files), not CUDA. Its tests are the default list but for
    SUITE_RUNS (GPU_CHECK_ONLY), which the suite runs on the CPU itself."""
    out = tmp_path / "out"
    run_here = [t for t in default_tests if t not in SUITE_RUNS]
    env = {**os.environ, "PDSERVE_CHECK_DEVICE": "cpu", "PDSERVE_CHECK_LAYERS": "2", "PYTHON": sys.executable,
           "GPU_BUNDLE": str(tmp_path / "none"), "GPU_CHECK_OUT": str(out),
           "GPU_CHECK_ONLY": " ".join(run_here)}
    run = subprocess.run(["bash", str(ROOT / "scripts/gpu_check.sh")], env=env, capture_output=True,
                         text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    files = sorted(p.name for p in out.iterdir())
    assert files == ["junit.xml", "nixl.json", "probe.json", "pytest.log", "step_profile.json"], run.stdout[-3000:]
    log = (out / "pytest.log").read_text()[-3000:]
    suite = ET.parse(out / "junit.xml").getroot().find("testsuite")
    counts = {k: int(suite.get(k)) for k in ("tests", "failures", "errors", "skipped")}
    assert counts["tests"] >= 25 and counts["failures"] == counts["errors"] == 0, (counts, log)
    # Skips: only what needs CUDA itself (graph capture: decode graphs and the pieces of steps
    # with prompt tokens; FP8 matmuls) or a device's share of memory (on the CPU a share of host
    # RAM is gigabytes: stand-ins and tests/engine check it).
    assert counts["skipped"] <= 8, (counts, log)
    ran = {case.get("classname") for case in suite.iter("testcase")}
    assert ran == {t.removesuffix(".py").replace("/", ".") for t in run_here}, (ran, log)  # every file ran tests
    assert all(row["bytes_equal"] for row in json.loads((out / "nixl.json").read_text()))
    assert json.loads((out / "probe.json").read_text())["torch"]
