"""Each rank's random number generators in a checkpoint, so that a run resumed at the same layout draws the dropout
masks (and every other random number) the run it resumes would have drawn.

Every rank writes its own file, ``rng/rank<r>.pt`` inside the checkpoint directory: torch's CPU generator, the CUDA
generator of the rank's device where it is one, Python's ``random`` and NumPy's global generator. The checkpoint's
metadata records the layout and world size it was saved at (:data:`SAVED_AT`). On loading at the same layout each
rank restores its own streams; at another (a resharded resume, an elastic re-layout) the old streams cannot be
mapped onto the new ranks, so rank 0 says so once and training goes on with the streams the ranks have.

The streams are restored when the checkpoint is loaded, as Accelerate's ``load_state`` restores its own: what draws
between the save and the next batch in the uninterrupted run (a new epoch's dataloader iterator draws its base seed
from the global generator) draws again between the load and the next batch of the resumed one.
"""

from __future__ import annotations

import random
import warnings
from pathlib import Path
from typing import Any

import torch

from lightning_par3d.checkpoint.safe_reading import load_file

RNG_DIR = "rng"
SAVED_AT = "par3d_rng_saved_at"
"""The metadata entry naming the layout (and world size) whose ranks wrote the checkpoint's streams."""


def rank_file(directory: Path, rank: int) -> Path:
    return directory / RNG_DIR / f"rank{rank}.pt"


def capture(device: torch.device) -> dict[str, Any]:
    """This process's generators: torch's CPU one, the CUDA one of ``device`` (a CUDA device), ``random``'s and
    NumPy's (where NumPy is installed), as tensors and plain values that ``torch.load(weights_only=True)`` reads."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    try:
        import numpy as np
    except ImportError:
        return state
    kind, keys, position, has_gauss, gauss = np.random.get_state(legacy=True)
    state["numpy"] = {
        "kind": kind,
        "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
        "position": int(position),
        "has_gauss": int(has_gauss),
        "gauss": float(gauss),
    }
    return state


def restore(state: dict[str, Any], device: torch.device) -> None:
    """Sets this process's generators to ``state`` (:func:`capture`'s)."""
    torch.set_rng_state(state["torch"])
    random.setstate(_as_tuples(state["python"]))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)
    if "numpy" in state:
        import numpy as np

        saved = state["numpy"]
        keys = saved["keys"].numpy().astype(np.uint32)
        np.random.set_state((saved["kind"], keys, saved["position"], saved["has_gauss"], saved["gauss"]))


def _as_tuples(value: Any) -> Any:
    """``random.setstate`` takes tuples; a checkpoint may hand lists back."""
    return tuple(_as_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value


def write(directory: Path, rank: int, device: torch.device) -> None:
    """Writes this rank's generators into the checkpoint (staging) directory ``directory``."""
    path = rank_file(directory, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(path.name + ".tmp")
    torch.save(capture(device), temporary)
    temporary.replace(path)


def saved_at(layout: str, world_size: int) -> str:
    """The metadata value of :data:`SAVED_AT` for a layout (its description) on ``world_size`` ranks."""
    return f"{layout} on {world_size} ranks"


def load(directory: Path, rank: int, saved: str | None, current: str, device: torch.device) -> bool:
    """Restores this rank's generators from the checkpoint ``directory`` if it was saved at the ``current`` layout
    (``saved``: its :data:`SAVED_AT` entry); returns whether it did. At another layout rank 0 says once why the
    random streams start afresh; a checkpoint saved without them (an earlier par3d) is loaded without a word."""
    path = rank_file(directory, rank)
    if saved is None or not path.is_file():
        return False
    if saved != current:
        if rank == 0:
            warnings.warn(
                f"par3d: the checkpoint's random streams were saved by the ranks of {saved}; this run is {current}, "
                "whose ranks cannot continue them. Training goes on, but random draws (dropout masks) after the "
                "resume differ from the run that saved it.",
                stacklevel=3,
            )
        return False
    restore(load_file(path, weights_only=True), device)
    return True
