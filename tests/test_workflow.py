"""The GitHub Actions workflow passes actionlint, and it runs what the README and .ci/run run."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

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
    assert "make test" in workflow and "pytest -m gpu" in workflow
