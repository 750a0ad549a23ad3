"""``par3d smoke``: a user's model at a layout against pure data parallelism, on gloo here (the
same command runs on GPUs under torchrun in the reusable workflow, ``.github/workflows/gpu-smoke.yml``)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from lightning_par3d.tools.smoke import main, parser, smoke
from tests import background

ROOT = Path(__file__).resolve().parents[1]
GPT = ["--module", "examples.gpt:GPTModule", *("--module-arg", "n_layer=2", "--module-arg", "n_embd=32"),
       "--module-arg", "block_size=32"]  # fmt: skip
LLAMA = ["--module", "tests.hf_runs:module"]
DATA = ["--data", "examples.data:ShakespeareDataModule", "--data-arg", "block_size=32", "--data-arg", "max_bytes=20000"]


def smoke_job(argv: list[str]) -> tuple[int, dict[str, Any]]:
    """The smoke command's two runs and checks, in a pool worker (its ranks are the command's)."""
    return smoke(parser().parse_args([*argv, "--accelerator", "cpu", "--timeout-s", "120"]))


@pytest.mark.parametrize("model", [GPT, LLAMA], ids=["gpt", "transformers-llama"])
@pytest.mark.parametrize("layout", ["dp_shard=2,tp=2", "pp=2,tp=2"])
def test_the_smoke_test_passes_a_model_that_trains_right(pool4, model, layout):
    status, result = pool4.run(smoke_job, argv=[*model, *DATA, "--layout", layout, "--steps", "3"])[0]
    assert status == 0 and result["passed"], result["checks"]
    assert [c["name"] for c in result["checks"]] == ["finite", "agree", "match"]
    assert len(result["losses"]["layout"]) == 3 and len(result["memory_per_rank"]) == 4
    assert result["memory_per_rank"][0]["params"] > 0 and all(t > 0 for t in result["step_s"]["layout"])


def _diverging(folder: Path) -> Any:
    """``python -m lightning_par3d smoke`` on a model planted to diverge at tp=2, launching its own 2 CPU ranks."""
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE")}
    command = [sys.executable, "-m", "lightning_par3d", "smoke", "--module", "tests.smoke_models:ShardDependentGPT",
               *GPT[2:], *DATA, "--layout", "tp=2", "--devices", "2", "--accelerator", "cpu", "--steps", "3",
               "--out", str(folder)]  # fmt: skip
    return folder, background.run(command, timeout=600, cwd=ROOT, env=env)


smoke_diverges = background.fixture("smoke_diverges", _diverging)


def test_the_smoke_test_fails_a_model_that_diverges_at_the_layout(smoke_diverges):
    """The model scales its MLPs by the share of a weight its rank holds: at tp=2 each rank holds half, so the
    layout's losses leave data parallelism's, and the command says so and exits 1, from a launch of its own
    processes."""
    folder, done = smoke_diverges
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-3000:]
    assert "[FAIL] match: the layout's losses" in done.stdout, done.stdout[-3000:]
    result = json.loads((folder / "result.json").read_text())
    assert result["passed"] is False and result["world_size"] == 2


def test_a_layout_that_does_not_divide_is_refused_before_any_process(capsys):
    status = main([*GPT, *DATA, "--layout", "tp=3", "--devices", "4", "--accelerator", "cpu"])
    assert status == 2
    err = capsys.readouterr().err
    assert "par3d smoke: bad input:" in err and "divisible by pp × dp_replicate × tp = 1 × 1 × 3" in err
    status = main([*GPT, *DATA, "--layout", "dp_shard=4", "--devices", "4", "--global-batch", "6"])
    assert status == 2 and "--global-batch 6 does not split over the 4 data-parallel ranks" in capsys.readouterr().err


def test_the_layout_is_read_as_par3d_fields():
    from lightning_par3d.tools.loading import parse_pairs

    assert parse_pairs("pp=2, dp_shard=2,tp=2,pipeline_schedule=gpipe", "--layout") == {
        "pp": 2, "dp_shard": 2, "tp": 2, "pipeline_schedule": "gpipe"
    }  # fmt: skip
    with pytest.raises(ValueError, match="write key=value"):
        parse_pairs("tp2", "--layout")
