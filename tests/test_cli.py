"""The Hydra app end to end, as a user runs it (``python examples/train.py ...`` on the real interpreter, whose
Lightning launcher starts the ranks): a short run trains, and misconfigured runs exit with the error instead of
hanging. Each run is a background case (``tests/background.py``): selecting one test runs only its command."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import background
from tests.test_docs import documented  # noqa: F401  (the docs' runs, parametrized below)

ROOT = Path(__file__).resolve().parents[1]


def train(folder: Path, *overrides: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """``python examples/train.py *overrides`` with its Hydra run folder in ``folder``."""
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE")}
    command = [sys.executable, "examples/train.py", *overrides, f"hydra.run.dir={folder}"]
    return background.run(command, timeout=timeout, cwd=ROOT, env=env)


too_wide_tp = background.fixture(
    "too_wide_tp",
    lambda folder: train(folder, "strategy.tp=3", "trainer.devices=4", "logger=none", "callbacks=none", timeout=300),
)
tp_does_not_divide_the_heads = background.fixture(
    "tp_does_not_divide_the_heads",
    lambda folder: train(
        folder,
        "strategy.tp=2",
        "trainer.devices=2",
        "model.n_head=3",
        "model.n_embd=48",
        "logger=none",
        "callbacks=none",
        timeout=300,
    ),
)
SMALL = ("model.n_layer=2", "model.n_embd=32", "trainer.limit_val_batches=2", "callbacks=none")
"""A smaller model and validation for the first-day runs below; everything else is the app's default."""
FIRST_DAY = {
    "bare": ("trainer.max_steps=3",),  # Lightning checks the validation interval against the epoch before any step
    # 47 training windows: batches of 16, 16 and 15, as the whole text's epoch ends (2,879 = 179 × 16 + 15); the
    # validation at batch 4 is the second epoch's first batch
    "pp2_tp2": (
        *("strategy.pp=2", "strategy.tp=2", "trainer.devices=4", "+data.max_bytes=3400"),
        *("trainer.max_steps=4", "trainer.val_check_interval=4"),
    ),
}
"""The commands a new user types first, each of which crashed once: the bare app (the default validation interval,
50 batches, was longer than a dp=4 epoch of 45, which Lightning refuses before the first step unless the interval
counts across epochs, as ``conf/trainer/cpu.yaml`` says), and pp=2 × tp=2 (its epoch ends in a batch of 15 samples,
which microbatches=4 does not divide; the run crosses an epoch's end, on a shorter text whose last batch is 15
samples too, and validates there, an interval longer than its epoch). The commands the README and the docs show
(``experiment=hsdp``, the ``tp_plan`` example, ``strategy.layout=auto`` …) run in ``tests/test_docs.py``."""
first_day = background.fixture(
    "first_day", lambda folder, name: (folder, train(folder, *FIRST_DAY[name], *SMALL)), params=list(FIRST_DAY)
)
unknown_mode = background.fixture(
    "unknown_mode", lambda folder: train(folder, "mode=profile", "logger=none", "callbacks=none", timeout=300)
)


@pytest.mark.parametrize("documented", ["python examples/train.py experiment=dp2_tp2"], indirect=True)
def test_train_app_runs_dp2_tp2(documented):  # noqa: F811  (the fixture imported above)
    """The docs' ``experiment=dp2_tp2`` (3 steps here) trains at the layout it names and says so. (The validation
    loss in the CSV log: the first-day run below.)"""
    _, out = documented
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-3000:]
    assert "par3d: pp=1 × dp_replicate=1 × dp_shard=2 × tp=2 on 4 ranks" in text
    assert "`max_steps=3` reached" in text


def test_the_first_commands_a_user_types_run_to_the_end(first_day):
    folder, out = first_day
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-3000:]
    assert "Trainer.fit` stopped: `max_steps=" in text, text[-3000:]
    if "strategy.pp=2" in out.args:
        assert "the last batch of each epoch of the training dataloader holds 15 samples" in text
        assert "it runs as 3 microbatches of 5" in text
    if "trainer.val_check_interval=4" in out.args:  # validation ran at batch 4, the second epoch's first
        rows = list(csv.DictReader((folder / "logs" / "version_0" / "metrics.csv").open()))
        assert [(r["epoch"], r["step"]) for r in rows if r.get("val_loss")] == [("1", "3")], rows


def test_layout_that_does_not_fit_exits_before_launching(too_wide_tp):
    out = too_wide_tp
    assert out.returncode != 0, out.stderr[-3000:]
    assert "needs the world size (4) to be divisible by pp × dp_replicate × tp = 1 × 1 × 3 = 3" in out.stderr, (
        out.stderr
    )


def test_model_that_tp_cannot_split_exits_on_every_rank_instead_of_hanging(tp_does_not_divide_the_heads):
    """The head-count check runs after the process group exists (it needs the model), on every rank alike, so
    both processes raise and exit rather than one waiting for the other in a collective; the job's console holds
    the cause once, not once per rank."""
    out = tp_does_not_divide_the_heads
    assert out.returncode != 0, out.stderr[-3000:]
    assert "tp=2 does not divide the head count model.transformer.h.0.attn.n_head=3" in out.stderr, out.stderr[-3000:]
    # Both ranks raise the same error; the console says so once: the rank that failed first, and one traceback.
    text = out.stdout + out.stderr
    assert text.count("par3d: rank ") == 1, text[-5000:]
    assert text.count("Error executing job") <= 1 and text.count("Traceback (most recent call last)") <= 1, text


@pytest.mark.parametrize("documented", ["python examples/train.py experiment=demo mode=estimate"], indirect=True)
def test_estimate_mode_prints_the_per_rank_table_without_launching(documented):  # noqa: F811
    """The docs' `mode=estimate` answers in the launching process: no rank is started (the demo's layout needs 8)."""
    _, out = documented
    assert out.returncode == 0, out.stderr[-3000:]
    assert "par3d memory estimate: pp=2 × dp_replicate=1 × dp_shard=2 × tp=2, ZeRO-3, 32-true" in out.stdout
    assert "| pp rank | stages | ranks | params | grads | optimizer | activations | in flight |" in out.stdout
    assert "| 0 | 0 | 0–3 |" in out.stdout and "| 1 | 1 | 4–7 |" in out.stdout
    assert "Initializing distributed" not in out.stdout + out.stderr


def test_unknown_mode_is_a_clear_error(unknown_mode):
    out = unknown_mode
    assert out.returncode != 0, out.stderr[-3000:]
    expected = "mode='profile' is not a mode. Allowed: 'train', 'estimate', 'plan', 'dryrun', 'advise'."
    assert expected in out.stderr, out.stderr[-3000:]


ACCELERATE_RUNS = {  # the docs' two `accelerate launch` commands (tests/test_docs.py runs each once)
    "gpt-pp2xtp2": "accelerate launch --config_file conf/accelerate/cpu4.yaml examples/accelerate_train.py "
    "strategy.pp=2 strategy.tp=2 steps=20",
    "llama-dp_shard2xtp2": "accelerate launch --config_file conf/accelerate/cpu4.yaml examples/accelerate_train.py "
    "model=hf_llama strategy.tp=2 steps=20",
}
LAYOUT_LINES = {
    "gpt-pp2xtp2": "par3d: pp=2 × dp_replicate=1 × dp_shard=1 × tp=2 on 4 ranks",
    "llama-dp_shard2xtp2": "par3d: pp=1 × dp_replicate=1 × dp_shard=2 × tp=2 on 4 ranks",
}


@pytest.mark.parametrize("documented", list(ACCELERATE_RUNS.values()), ids=list(ACCELERATE_RUNS), indirect=True)
def test_accelerate_launch_trains_and_prints_no_third_party_warning(documented):  # noqa: F811
    """The Accelerate example through Accelerate's own launcher (the docs' runs, 4 ranks by torchrun) trains at the
    layout it names, evaluates at its end, and prints no warning from torch, Accelerate or Lightning (it printed
    DTensor's "sequential all_reduce" warning on every rank, from the gradient clipping at dp_shard=2 × tp=2, the
    layout ``make accelerate`` trains the GPT at; its command is the docs' with ``strategy.tp=2`` alone: below)."""
    _, out = documented
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout + out.stderr
    name = "llama-dp_shard2xtp2" if "model=hf_llama" in out.args else "gpt-pp2xtp2"
    assert LAYOUT_LINES[name] in text, text[-3000:]
    assert "final metrics: train_loss=" in text
    warnings = [line for line in text.splitlines() if "warn" in line.lower() or "]:W" in line]
    assert not warnings, "\n".join(warnings)


def test_make_accelerate_runs_the_documented_example_at_dp_shard2xtp2():
    """``make accelerate`` is the docs' command of the GPT with the layout ``strategy.tp=2`` (dp_shard=2 × tp=2 on the
    4 ranks of ``cpu4.yaml``), the layout of the docs' Llama run, both checked above."""
    target = (ROOT / "Makefile").read_text().split("\naccelerate:", 1)[1].split("\n")[1].strip()
    launcher, rest = target.split(" launch ", 1)
    assert launcher == "$(VENV)/bin/accelerate"
    gpt = ACCELERATE_RUNS["gpt-pp2xtp2"].removeprefix("accelerate launch ")
    assert rest == gpt.replace("strategy.pp=2 strategy.tp=2 steps=20", "strategy.tp=2"), rest
