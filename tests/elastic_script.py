"""A user's elastic training script, as torchrun's elastic agent runs it (again from the start at each restart):

    torchrun --nnodes 1:2 --nproc-per-node 2 --max-restarts 3 --rdzv-backend c10d --rdzv-endpoint HOST:PORT \\
        tests/elastic_script.py OUT '{"dp_shard": 2, "tp": 2}' 8

trains the example GPT with ``Par3DStrategy(elastic=True)``, 4 samples per data-parallel rank and batch (the global
batch of ``tests.constants`` on 4 ranks at dp=2), writes ``last.ckpt`` into ``OUT/ckpt`` after every step, and
resumes from the newest with ``ckpt_path="last"``. Rank 0 appends each optimizer step (its loss, the data-parallel
mean, summed over its accumulated batches; the input rows every rank read in it; the world size) to
``OUT/steps.jsonl``, and ``OUT/final.pt`` holds the whole model's parameters at the end.

For the test to take a node away and give it back at known points:

* on 4 ranks, at the start of step 3, rank 2 (the second node) writes ``OUT/lose_node`` and waits: the test kills
  that node's agent and its workers, and the first node's ranks find their peers gone;
* on 2 ranks, at the start of step 5, rank 0 writes ``OUT/add_node`` and waits: the test starts another agent, and
  the running agent restarts its workers at 4 ranks;
* or, with ``PAR3D_FAIL_ONCE=RANK:STEP``, that rank raises at that step in the first launch, and the agent restarts
  the workers (a restart after a failure).

Each rank also writes wall-clock times (``OUT/times.jsonl``: the script's start, the process group and mesh ready,
the checkpoint loaded, the first step done, a failure seen), from which the test reads the recovery time.
"""

from __future__ import annotations

import time

STARTED = time.time()

import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning as L  # noqa: E402
import torch  # noqa: E402

from examples.data import ShakespeareDataModule  # noqa: E402
from examples.gpt import GPTModule  # noqa: E402
from lightning_par3d import Par3DConfig, Par3DStrategy  # noqa: E402
from tests.constants import DATA, MODEL, SEED  # noqa: E402
from tests.gpt_runs import StepRecorder, full_state  # noqa: E402

RANK_BATCH = 4
TIMEOUT_S = 20
FAIL_ONCE = os.environ.get("PAR3D_FAIL_ONCE", "")
"""``RANK:STEP``: that rank raises at the start of that step in the first launch (the agent's restart count 0); the
test of a restart after a failure sets it, and then the script takes no node away and waits for none."""


def note(out: Path, event: str, **extra: Any) -> None:
    with (out / "times.jsonl").open("a") as f:
        f.write(
            json.dumps(
                {"event": event, "time": time.time(), "rank": int(os.environ["RANK"]), "pid": os.getpid(), **extra}
            )
            + "\n"
        )


def wait_to_be_stopped(out: Path, name: str) -> None:
    """Writes ``out/name`` and waits until a signal ends the process (the test kills it, or the agent stops it)."""
    (out / name).write_text(str(time.time()))
    while True:
        time.sleep(0.2)


class Steps(StepRecorder):
    """Each step's record appended to ``OUT/steps.jsonl`` (rank 0), the times of the run's milestones, and the
    pauses at which the test takes a node away and adds one."""

    def __init__(self, out: Path) -> None:
        super().__init__()
        self.out = out
        self.first_done = False

    def setup(self, trainer: L.Trainer, pl_module: Any, stage: str) -> None:
        note(self.out, "process_group_and_mesh", world=trainer.world_size)

    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        note(self.out, "checkpoint_loaded", step=checkpoint.get("global_step"))

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        super().on_train_batch_start(trainer, *args)
        world, step, rank = trainer.world_size, trainer.global_step, trainer.global_rank
        if world == 4 and step == 3 and rank == 2 and not FAIL_ONCE:
            wait_to_be_stopped(self.out, "lose_node")
        if world == 2 and step == 5 and rank == 0 and not FAIL_ONCE:
            wait_to_be_stopped(self.out, "add_node")
        if f"{rank}:{step}" == FAIL_ONCE and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
            raise RuntimeError(f"injected failure on rank {rank} at step {step}, in the first launch only")

    def on_step_done(self, trainer: L.Trainer, step: int, record: dict[str, Any]) -> None:
        if trainer.is_global_zero:
            line = {"step": step, "world": trainer.world_size, "loss": record["loss"], "rows": sorted(record["rows"])}
            with (self.out / "steps.jsonl").open("a") as f:
                f.write(json.dumps(line) + "\n")
        if not self.first_done:
            self.first_done = True
            note(self.out, "first_step", world=trainer.world_size, step=trainer.global_step)

    def on_exception(self, trainer: L.Trainer, pl_module: Any, exception: BaseException) -> None:
        note(self.out, "failure_seen", error=type(exception).__name__)


def main(out: Path, layout: dict[str, Any], max_steps: int) -> None:
    signal.signal(signal.SIGTERM, lambda *_: os._exit(143))  # the agent stops workers with SIGTERM
    launch = {k: os.environ.get(f"TORCHELASTIC_{k.upper()}") for k in ("restart_count", "use_agent_store")}
    note(out, "script_start", world=int(os.environ["WORLD_SIZE"]), at=STARTED, **launch)
    L.seed_everything(SEED, verbose=False)
    world = int(os.environ["WORLD_SIZE"])
    per_node = int(os.environ["LOCAL_WORLD_SIZE"])
    strategy = Par3DStrategy(Par3DConfig(**layout, elastic=True, timeout_s=TIMEOUT_S))
    saver = L.pytorch.callbacks.ModelCheckpoint(
        dirpath=out / "ckpt", save_last=True, save_top_k=0, every_n_train_steps=1
    )
    trainer = L.Trainer(
        accelerator="cpu", devices=per_node, num_nodes=world // per_node, strategy=strategy, max_steps=max_steps,
        callbacks=[Steps(out), saver], logger=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0,
    )  # fmt: skip
    module = GPTModule(**MODEL)
    trainer.fit(module, ShakespeareDataModule(batch_size=RANK_BATCH, **DATA), ckpt_path="last")
    params = full_state(module)
    if trainer.is_global_zero:
        torch.save(params, out / "final.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), json.loads(sys.argv[2]), int(sys.argv[3]))
