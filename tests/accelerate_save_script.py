"""An Accelerate training script killed (SIGKILL) part-way through its second ``save_state``, as torchrun starts it.

    python tests/accelerate_save_script.py OUT POINT [async]

trains the example GPT through ``Par3DAccelerator`` with an LR scheduler, one step, ``save_state(OUT/state)``
(complete: it writes ``OUT/first.pt`` with what it saved: the step, the scheduler's ``last_epoch`` and the
parameters), one more step, and a second ``save_state(OUT/state)`` killed at POINT (``OUT/killed_at`` marks it):

* ``accelerate_files`` — Accelerate's own files (scheduler, RNG, sampler) written, par3d's shards not yet;
* ``shards`` — inside DCP's write of the shards (with ``async``: on DCP's thread, while training goes on);
* ``renames`` — between the two renames that put the new folder in place (with ``async``: on DCP's thread).

The process is rank 0 of a world of one, with the variables ``torchrun --nproc-per-node 1`` sets (the test gives
them): every step of the folder's save is rank 0's; the other ranks' part, their shards, is what
``tests/test_faults.py`` kills at two ranks.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from examples.fabric_train import gpt_loss
from examples.gpt import GPT, GPTConfig
from tests.accelerate_runs import GPT_MODEL, _accelerator, _data, _optimizer
from tests.constants import SEED
from tests.gpt_runs import full_state


def killed(out: Path) -> None:
    (out / "killed_at").write_text(str(time.time()))
    os.kill(os.getpid(), signal.SIGKILL)


def arm(point: str, out: Path) -> None:
    """Makes the next save die at ``point``."""
    from torch.distributed.checkpoint import FileSystemWriter

    from lightning_par3d.checkpoint import atomic
    from lightning_par3d.engine import Par3DEngine
    from lightning_par3d.integrations import accelerate_state

    if point == "accelerate_files":
        Par3DEngine.save = lambda *args, **kwargs: killed(out)  # type: ignore[method-assign]
    elif point == "shards":
        FileSystemWriter.write_data = lambda *args, **kwargs: killed(out)  # type: ignore[method-assign]
    elif point == "renames":
        swap = atomic.swap_into_place

        def rename_then_die(staging: Path, path: Path) -> None:
            if path.name != "state":  # the par3d checkpoint inside the staging folder: swapped as usual
                return swap(staging, path)
            os.rename(path, atomic.previous_name(path))
            killed(out)

        accelerate_state.atomic.swap_into_place = rename_then_die  # type: ignore[attr-defined]
    else:
        raise ValueError(point)


def main(out: Path, point: str, background: bool) -> None:
    accelerator = _accelerator(dict(async_save=True) if background else {})
    torch.manual_seed(SEED)
    model = GPT(GPTConfig(**GPT_MODEL))
    optimizer = _optimizer(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    model, optimizer, scheduler, loader = accelerator.prepare(model, optimizer, scheduler, _data(8))
    batches = iter(loader)

    def step() -> None:
        x, y = next(batches)
        accelerator.train_step(model, x, y, gpt_loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()

    step()
    accelerator.save_state(str(out / "state"))
    accelerator.wait_for_everyone()
    accelerator.engine.wait_for_saves()
    first = {"step": accelerator.step, "last_epoch": scheduler.scheduler.last_epoch, "params": full_state(model)}
    torch.save(first, out / "first.pt")
    step()
    arm(point, out)
    accelerator.save_state(str(out / "state"))
    if background:  # the kill comes on DCP's thread, while training goes on
        for _ in range(600):
            time.sleep(0.1)
    raise SystemExit(f"the save was not killed at {point}")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], "async" in sys.argv[3:])
