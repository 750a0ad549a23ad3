"""The Hydra app end to end, with Lightning's own launcher: a short run trains, and misconfigured runs exit with
the error instead of hanging."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def train(*overrides: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE")}
    return subprocess.run(
        [sys.executable, "examples/train.py", *overrides],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.dist
def test_train_app_runs_dp2_tp2_and_logs_the_loss(tmp_path):
    out = train(
        "experiment=dp2_tp2",
        "trainer.max_steps=4",
        "trainer.val_check_interval=2",
        "trainer.limit_val_batches=2",
        "model.n_layer=2",
        "model.n_embd=64",
        "callbacks=none",
        f"hydra.run.dir={tmp_path}",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "par3d: pp=1 × dp_replicate=1 × dp_shard=2 × tp=2 on 4 ranks" in out.stdout + out.stderr
    rows = list(csv.DictReader((tmp_path / "logs" / "version_0" / "metrics.csv").open()))
    assert [r for r in rows if r.get("val_loss")], "validation loss was not logged"


def test_layout_that_does_not_fit_exits_before_launching():
    out = train("strategy.tp=3", "trainer.devices=4", "logger=none", "callbacks=none", timeout=60)
    assert out.returncode != 0
    assert "needs the world size (4) to be divisible by pp × dp_replicate × tp = 1 × 1 × 3 = 3" in out.stderr


@pytest.mark.dist
def test_model_that_tp_cannot_split_exits_on_every_rank_instead_of_hanging():
    """The head-count check runs after the process group exists (it needs the model), on every rank alike, so
    both processes raise and exit rather than one waiting for the other in a collective."""
    out = train(
        "strategy.tp=2",
        "trainer.devices=2",
        "model.n_head=3",
        "model.n_embd=48",
        "logger=none",
        "callbacks=none",
        timeout=180,
    )
    assert out.returncode != 0
    assert "tp=2 does not divide the head count model.transformer.h.0.attn.n_head=3" in out.stderr


def test_estimate_mode_prints_the_per_rank_table_without_launching():
    """`mode=estimate` answers in the launching process: no rank is started (the demo's layout needs 8)."""
    out = train("experiment=demo", "mode=estimate", "strategy.activation_checkpointing=full", timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "par3d memory estimate: pp=2 × dp_replicate=1 × dp_shard=2 × tp=2, ZeRO-3, 32-true" in out.stdout
    assert "| pp rank | stages | ranks | params | grads | optimizer | activations | in flight |" in out.stdout
    assert "| 0 | 0 | 0–3 |" in out.stdout and "| 1 | 1 | 4–7 |" in out.stdout
    assert "Initializing distributed" not in out.stdout + out.stderr


def test_unknown_mode_is_a_clear_error():
    out = train("mode=profile", "logger=none", "callbacks=none", timeout=60)
    assert out.returncode != 0
    assert "mode='profile' is not a mode. Allowed: 'train', 'estimate'." in out.stderr
