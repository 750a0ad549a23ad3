"""One rank of a 2-rank job that counts its OS threads around ``groups.destroy_meshes()``.

    python tests/mesh_threads_script.py RANK PORT

prints one JSON line: the threads before any mesh, with the meshes of three layouts (dp_shard=2, tp=2, pp=2), and
after ``destroy_meshes``, and how many meshes it destroyed. It imports the engine's layers only (no Lightning), so
each rank costs an interpreter with torch and no more.
"""

from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist

from lightning_par3d.config import Par3DConfig, resolve_layout
from lightning_par3d.distributed import groups


def threads() -> int:
    return len(os.listdir("/proc/self/task"))


def main(rank: int, port: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    before = threads()
    for config in (Par3DConfig(dp_shard=2), Par3DConfig(tp=2), Par3DConfig(pp=2)):
        groups.acquire_mesh(resolve_layout(config, 2), torch.device("cpu"), "gloo", 60)
    held = threads()
    destroyed = groups.destroy_meshes()
    gc.collect()
    print(json.dumps({"before": before, "held": held, "after": threads(), "destroyed": destroyed}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
