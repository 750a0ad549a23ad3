"""A user's training script as a multi-node launcher runs it: the example GPT at several par3d layouts in turn, in
the same processes, under torchrun (``--nnodes``, c10d rendezvous) or SLURM (``srun`` sets ``SLURM_*``).

    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:PORT \\
        tests/multinode_script.py OUT '[{"dp_shard": 2, "tp": 2}, {"pp": 2, "dp_shard": 2}]' 2

trains each layout (a JSON object of ``Par3DConfig`` fields) for ``tests.constants`` ' run: 6 steps of the global
batch, with ``Trainer(num_nodes=NODES, devices=WORLD // NODES)``. For the ``i``-th layout, rank 0 writes
``OUT/run{i}.pt`` (each step's loss, the data-parallel mean, and the whole model's parameters) and every rank writes
``OUT/place{i}_{rank}.json``: its node (as the launcher numbered it) and the ranks of each of its mesh groups. With a
fourth argument, a checkpoint directory, a last run of the first layout checkpoints there
(:func:`node_local_checkpoints`).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning as L
import torch
import torch.distributed as dist

from tests.gpt_runs import run_par3d

DIMENSIONS = ("pp", "dp_replicate", "dp_shard", "tp")


def node_rank() -> int:
    """This process's node as the launcher numbered it: torchrun's ``GROUP_RANK``, SLURM's ``SLURM_NODEID``."""
    return int(os.environ.get("GROUP_RANK", os.environ.get("SLURM_NODEID", "0")))


def node_local_checkpoints(out: Path, layout: dict, world: int, nodes: int, directory: str) -> None:
    """A run that would checkpoint into ``/proc/self/cwd/<directory>``: one path, which each process resolves in its
    own working directory, so that where the agents' working directories differ, each "node" has a directory of its
    own at the same path, as node-local disks mounted alike would be. (Set on the callback after it is made:
    ``ModelCheckpoint`` would resolve the link on rank 0 and send rank 0's directory to every rank.) Every rank writes
    ``OUT/shared<rank>.txt`` with the error it raised before training."""
    callback = L.pytorch.callbacks.ModelCheckpoint(save_last=True)
    callback.dirpath = f"/proc/self/cwd/{directory}"
    try:
        run_par3d(layout, devices=world // nodes, num_nodes=nodes, extra_callbacks=[callback])
        (out / "trained_node_local").write_text("trained")
    except ValueError as error:
        (out / f"shared{dist.get_rank()}.txt").write_text(str(error))


def main(out: Path, layouts: list[dict], nodes: int, node_local: str | None = None) -> None:
    world = int(os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", "1")))
    for i, layout in enumerate(layouts):
        result = run_par3d(layout, devices=world // nodes, num_nodes=nodes, keep_module=True)
        strategy = result["module"].trainer.strategy
        mesh = strategy.mesh
        place = {"node": node_rank(), "rank": dist.get_rank()}
        for name in DIMENSIONS:
            if getattr(mesh.layout, name) > 1:
                place[name] = dist.get_process_group_ranks(mesh[name].get_group())
        (out / f"place{i}_{dist.get_rank()}.json").write_text(json.dumps(place))
        if dist.get_rank() == 0:
            torch.save({"losses": result["losses"], "params": result["params"]}, out / f"run{i}.pt")
        L.pytorch.utilities.rank_zero_info(f"multinode_script: layout {i} done")
    if node_local is not None:  # last: a failed run silences the ranks that did not fail first
        node_local_checkpoints(out, layouts[0], world, nodes, node_local)


if __name__ == "__main__":
    main(Path(sys.argv[1]), json.loads(sys.argv[2]), int(sys.argv[3]), *sys.argv[4:5])
