"""The wheel `pip install .` builds (the image's install, deploy/Dockerfile) holds one import
name, ``pdserve``, and every file of the package: the C++ kernels' sources that it compiles
on first use and the planner's CPU profile as well as the Python modules."""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_wheel_holds_one_import_name_and_every_file_of_it(tmp_path):
    # What the Dockerfile copies before `pip install .`, built without the network.
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "pdserve", src / "pdserve", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    out = tmp_path / "wheel"
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                            "-q", "-w", str(out), str(src)], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = out.glob("pdserve-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())

    assert {n.split("/")[0] for n in names if ".dist-info/" not in n} == {"pdserve"}
    top_level = next(n for n in names if n.endswith(".dist-info/top_level.txt"))
    assert zipfile.ZipFile(wheel).read(top_level).decode().split() == ["pdserve"]
    ours = {p.relative_to(src).as_posix() for p in (src / "pdserve").rglob("*") if p.is_file()}
    assert not ours - names, f"not in the wheel: {sorted(ours - names)}"
