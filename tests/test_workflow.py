"""The GitHub Actions workflow passes actionlint, and it runs what the README and .ci/run run."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_workflow_passes_actionlint():
    beside_python = Path(sys.executable).with_name("actionlint")
    actionlint = str(beside_python) if beside_python.exists() else shutil.which("actionlint")
    assert actionlint, "actionlint is part of the test extra: pip install -e '.[test]'"
    out = subprocess.run([actionlint, "-no-color"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def test_ci_and_readme_run_the_same_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    readme = (ROOT / "README.md").read_text()
    assert "make test" in ci
    assert "make test" in readme and "make demo" in readme
    workflow = (ROOT / ".github" / "workflows" / "ci.yml").read_text()
    assert "make test" in workflow and "make lint" in workflow
    assert "pytest -m gpu" in (ROOT / ".github" / "workflows" / "gpu-smoke.yml").read_text()


def test_the_ci_calls_the_reusable_gpu_workflow_which_users_can_call_too():
    import yaml

    ci = yaml.safe_load((ROOT / ".github" / "workflows" / "ci.yml").read_text())
    gpu = ci["jobs"]["test-gpu"]
    assert gpu["uses"] == "./.github/workflows/gpu-smoke.yml" and gpu["with"]["run-tests"] is True
    assert "vars.GPU_RUNS_ON" in (ROOT / ".github" / "workflows" / "ci.yml").read_text()
    reusable = yaml.safe_load((ROOT / ".github" / "workflows" / "gpu-smoke.yml").read_text())
    triggers = reusable[True]  # YAML reads the key `on` as True
    inputs = triggers["workflow_call"]["inputs"]
    for name in ("runs-on", "gpus", "layouts", "module", "steps", "precision", "python-version", "torch-spec",
                 "torch-index-url", "timeout-minutes"):  # fmt: skip
        assert name in inputs, name
    assert reusable["permissions"] == {"contents": "read"} and ci["permissions"] == {"contents": "read"}
    assert "cancel-in-progress" in ci["concurrency"] and "refs/heads/main" in str(ci["concurrency"])


HOST_PATTERNS = [
    r"(?:--|\b)(?:extra-)?index-url[= ]+https?://",  # an explicit index address
    r"https?://[\w.-]*(?:py" r"pi|python" r"hosted)\.(?:org|io)",  # the Python package index's hosts
    r"https?://download\.py" r"torch\.org",  # PyTorch's wheel indexes
]


def test_no_package_index_host_in_the_tracked_files():
    """The index to take torch from comes from a repository variable or the workflow's input: no host is named."""
    import re

    listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    found = []
    for name in listed:
        path = ROOT / name
        if not path.is_file() or path.suffix in (".png", ".jpg", ".txt"):
            continue
        text = path.read_text(errors="replace")
        found += [f"{name}: {m.group(0)}" for p in HOST_PATTERNS for m in re.finditer(p, text)]
    assert not found, found


def test_a_gpu_session_that_must_have_gpus_fails_without_them(monkeypatch):
    """``PAR3D_REQUIRE_GPUS=2 pytest -m gpu`` on a machine without them exits non-zero (3) at the session's start and
    says why, where the GPU tests would otherwise all skip and pass (the hook, called as pytest calls it)."""
    import torch

    from tests.conftest import pytest_sessionstart

    if torch.cuda.device_count() >= 2:
        pytest.skip("this machine has the GPUs")
    monkeypatch.setenv("PAR3D_REQUIRE_GPUS", "2")
    with pytest.raises(pytest.exit.Exception) as exited:
        pytest_sessionstart(None)  # type: ignore[arg-type]
    assert exited.value.returncode == 3
    assert "PAR3D_REQUIRE_GPUS=2, but no GPU was found" in str(exited.value)
