"""``python -m lightning_par3d.callbacks.estimate_child DIR``: the memory estimate for ``MemoryStats``.

The estimator builds every stage in a fake process group of its own, so it cannot run inside a rank whose process
group exists; ``MemoryStats`` runs it here, in a child process, from ``DIR/in.pkl``, and reads ``DIR/out.pkl``.
"""

from __future__ import annotations

import pickle
import sys
from pathlib import Path


def main(workdir: Path) -> None:
    from lightning_par3d.estimate import estimate_memory

    payload = pickle.loads((workdir / "in.pkl").read_bytes())
    module = pickle.loads(payload["module"])
    estimate = estimate_memory(
        module,
        payload["config"],
        payload["world_size"],
        payload["batch"],
        precision=payload["precision"],
        optimizer=payload["optimizer"],
    )
    (workdir / "out.pkl").write_bytes(pickle.dumps(estimate))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
