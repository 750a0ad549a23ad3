"""A small par3d training run that fails on purpose, as its own process tree (Lightning's subprocess launcher).

    python tests/fault_script.py OUT '{"dp_shard": 2}' 2 stall 1 3

trains the example GPT at the layout (a JSON of Par3DConfig fields) on DEVICES CPU processes (GPUs over NCCL where
``PAR3D_FAULT_ACCELERATOR=gpu``; ``timeout_s`` is ``tests.constants.FAULT_TIMEOUT_S``, one global batch per epoch),
and at the start of step STEP, on rank RANK, injects FAULT: ``kill`` (SIGKILL), ``stall`` (sleeps forever), ``raise``
(an exception in this step only), ``raise_measuring`` (with ``layout="auto"``: an exception on RANK alone as
measuring starts its second candidate, whose collectives the other ranks then wait in) or ``none``. Every rank writes
``OUT/pid<rank>`` with its PID at start; the faulting rank (or the rank a save kills) writes ``OUT/fault_at`` with
the wall-clock time of the fault; a rank whose ``fit`` raises writes ``OUT/raised<rank>`` with the time it did, and
every rank writes ``OUT/atexit<rank>`` as its interpreter begins to exit. With ``checkpoints`` the run saves
``last.ckpt`` every step into ``OUT/ckpt`` (the kill-during-save cases patch the save from ``KILL_SAVE``:
``<rank>:<point>``).
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning as L

from examples.data import ShakespeareDataModule
from examples.gpt import GPTModule
from lightning_par3d import Par3DStrategy
from tests.constants import FAULT_DATA, FAULT_TIMEOUT_S, GLOBAL_BATCH, MODEL, SEED  # as the tests' references
from tests.gpt_runs import trainer_kwargs

INJECTED_AT_STEP = ("kill", "stall", "raise")


class Fault(L.Callback):
    def __init__(self, out: Path, kind: str, rank: int, step: int) -> None:
        self.out, self.kind, self.rank, self.step = out, kind, rank, step

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step != self.step or trainer.global_rank != self.rank or self.kind not in INJECTED_AT_STEP:
            return
        note_the_fault(self.out)
        if self.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.kind == "stall":
            time.sleep(10**6)
        if self.kind == "raise":
            raise RuntimeError(f"injected failure on rank {self.rank} at step {self.step}")


def note_the_fault(out: Path) -> None:
    """Writes ``out/fault_at``, the time of the fault."""
    stamp(out / "fault_at")


def stamp(path: Path, text: str = "") -> None:
    """Writes ``text`` (by default the time) to ``path`` whole: the test polls for it, and a rank may be killed
    while it writes."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text or str(time.time()))
    os.replace(partial, path)


def kill_during_save(spec: str, out: Path) -> None:
    """``<rank>:<point>``: SIGKILL this rank at that point of the second save of ``last.ckpt`` (the first
    completes): ``writing`` (inside DCP's write of the rank's shards), ``before_meta`` (rank 0, shards written,
    ``meta.pt`` not yet), ``between_renames`` (rank 0, the old checkpoint set aside, the new one not in place)."""
    from torch.distributed.checkpoint import FileSystemWriter

    from lightning_par3d.checkpoint import atomic
    from lightning_par3d.checkpoint import dcp as ckpt

    rank, point = spec.split(":")
    if int(os.environ.get("LOCAL_RANK", "0")) != int(rank):
        return
    saves_of_last = [0]

    def second_save_of_last(target: Any) -> bool:
        if "last.ckpt" in str(target):
            saves_of_last[0] += 1
        return saves_of_last[0] == 2

    if point == "writing":
        write = FileSystemWriter.write_data

        def write_then_die(self: Any, *args: Any, **kwargs: Any) -> Any:
            if second_save_of_last(self.path):
                note_the_fault(out)
                os.kill(os.getpid(), signal.SIGKILL)
            return write(self, *args, **kwargs)

        FileSystemWriter.write_data = write_then_die  # type: ignore[method-assign]
        return
    name = "_write_file" if point == "before_meta" else "_swap_into_place"
    original = getattr(ckpt, name)

    def die_at_second(*args: Any, **kwargs: Any) -> Any:
        target = args[0] if point == "before_meta" else args[1]
        if second_save_of_last(target):
            if point == "between_renames":
                os.rename(args[1], atomic.previous_name(args[1]))
            note_the_fault(out)
            os.kill(os.getpid(), signal.SIGKILL)
        return original(*args, **kwargs)

    setattr(ckpt, name, die_at_second)


def raise_while_measuring(out: Path, rank: int) -> None:
    """On rank ``rank``, ``layout="auto"``'s measuring raises as it starts its second candidate."""
    from lightning_par3d.engine import trial

    if int(os.environ.get("LOCAL_RANK", "0")) != rank:
        return
    original, calls = trial.measure_step, [0]

    def second_fails(*args: Any, **kwargs: Any) -> float:
        calls[0] += 1
        if calls[0] == 2:
            note_the_fault(out)
            raise RuntimeError(f"injected failure on rank {rank} while measuring")
        return original(*args, **kwargs)

    trial.measure_step = second_fails  # type: ignore[assignment]


def main() -> None:
    out, layout, devices, kind, rank, step = sys.argv[1:7]
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    stamp(out_dir / f"pid{local_rank}", str(os.getpid()))
    atexit.register(stamp, out_dir / f"atexit{local_rank}")
    if os.environ.get("KILL_SAVE"):
        kill_during_save(os.environ["KILL_SAVE"], out_dir)
    if kind == "raise_measuring":
        raise_while_measuring(out_dir, int(rank))
    checkpoints = "checkpoints" in sys.argv[7:]
    callbacks: list[L.Callback] = [Fault(out_dir, kind, int(rank), int(step))]
    if checkpoints:
        callbacks.append(L.pytorch.callbacks.ModelCheckpoint(dirpath=out_dir / "ckpt", save_last=True, save_top_k=-1))
    strategy = Par3DStrategy(timeout_s=FAULT_TIMEOUT_S, **json.loads(layout))
    trainer = L.Trainer(
        devices=int(devices),
        strategy=strategy,
        callbacks=callbacks,
        **trainer_kwargs(
            max_steps=int(step) + 3,
            enable_checkpointing=checkpoints,
            accelerator=os.environ.get("PAR3D_FAULT_ACCELERATOR", "cpu"),
        ),
    )
    L.seed_everything(SEED, verbose=False)
    dp = int(devices) if strategy.engine.awaits_layout else strategy.layout.dp  # "auto" keeps batch x world
    data = ShakespeareDataModule(block_size=32, batch_size=GLOBAL_BATCH // dp, **FAULT_DATA)
    try:
        trainer.fit(GPTModule(**MODEL), data)
    except BaseException:
        stamp(out_dir / f"raised{local_rank}")  # when the failure reached the script
        raise


if __name__ == "__main__":
    main()
