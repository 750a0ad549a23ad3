"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP), laid out as Lightning's own, saved atomically and
checked before loading.

A checkpoint is a directory: DCP's shard files plus ``.metadata`` hold the model (``state_dict``, or the key the
front-end gives) and the optimizers (``optimizer_0``, …), each rank writing only its shards; ``meta.pt``, written
by rank 0, holds everything else Lightning saves (loops, callbacks, hyper-parameters). It is the layout of
Lightning's ``ModelParallelStrategy``, so Lightning's ``consolidate_checkpoint`` turns it into a single file.

Saving is atomic from the user's point of view (:mod:`~lightning_par3d.checkpoint.atomic`): rank 0 takes the
path's save lock (a second job saving there fails clearly), every rank writes into a hidden staging directory of
this save's own next to the target (``.<name>.partial-<token>``), rank 0 writes ``meta.pt`` last, and only then is
the staging directory renamed into place (an existing checkpoint of that name is first renamed to ``.<name>.old``
and removed after), the files and the parent directory flushed to disk. A save killed at any moment leaves the
previous checkpoint complete: at its name, or, killed between the two renames, at ``.<name>.old``, from where
:func:`resolve_checkpoint` takes it (and the next save puts it back). A directory without ``meta.pt`` is never
taken for a checkpoint.

Loading runs nothing in the checkpoint (:mod:`~lightning_par3d.checkpoint.safe_reading`): DCP's ``.metadata`` is
read by an unpickler that resolves only the exact names of DCP's own metadata classes, tensors and non-tensor
entries (optimizer hyper-parameters) with ``torch.load(..., weights_only=True)``, and ``meta.pt``, Lightning's own
loop and callback state, with the ``weights_only`` the caller passes (Lightning's ``trainer.fit(...,
weights_only=...)``; torch's default, ``True``, when None).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from lightning_par3d.checkpoint import atomic
from lightning_par3d.checkpoint.safe_reading import (
    DCP_METADATA,
    UnsafeCheckpointError,
    load_file,
    load_shards,
    read_metadata,
)
from lightning_par3d.distributed.agree import on_rank_zero
from lightning_par3d.parallel.packed_shards import contiguous_copies, copy_back, put_back
from lightning_par3d.zero.optimizer import ZeroOptimizer

METADATA_FILENAME = "meta.pt"
"""Rank 0's file of everything but the model and optimizer tensors; written last, so it marks a complete save."""


def model_state(module: nn.Module) -> dict[str, Any]:
    """The model's state dict with each rank's shards (DTensors): nothing is gathered."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(module)


def full_state_dict(module: nn.Module, holds_copy: bool = True, dst: int = 0) -> dict[str, torch.Tensor] | None:
    """The whole model's state dict, unsharded, on rank ``dst`` (None on the other ranks).

    Each DTensor is gathered over its own mesh (``full_tensor()``, a collective of its tp and dp peers), then the
    entries of every rank for which ``holds_copy`` is True (one rank per pipeline stage suffices: the others hold
    the same values) are merged on ``dst``. Every rank must call it. ``dst`` ends up holding the whole model.

    torch warns, once per rank, that a parameter sharded by FSDP2 over tp's shards is gathered in two all-gathers
    ("may give inconsistent results between ranks due to different reduction orders"): an all-gather reduces
    nothing, and this gather runs once per save, so the warning is held back here."""
    from torch.distributed.tensor import DTensor

    state: dict[str, torch.Tensor] = {}
    redistribute_log = logging.getLogger("torch.distributed.tensor._redistribute")
    level = redistribute_log.level
    redistribute_log.setLevel(logging.ERROR)
    try:
        for name, value in model_state(module).items():
            full = value.full_tensor() if isinstance(value, DTensor) else value
            if holds_copy:
                state[name] = full.detach().clone().cpu()  # clone: full_tensor() may return an async result
    finally:
        redistribute_log.setLevel(level)
    if not dist.is_initialized():
        return state
    parts: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == dst else None
    dist.gather_object(state, parts, dst=dst)
    if parts is None:
        return None
    merged: dict[str, torch.Tensor] = {}
    for part in parts:
        merged.update(part or {})
    return merged


# Flattened optimizer state: every entry, param_groups settings included, is keyed by parameter name
# ("param_groups.model.h.2.attn.q_proj.weight.lr"), so pipeline ranks, which hold different parameters, never write
# the same key with different contents, and any layout reads back what it owns.
_OPTIM_OPTIONS: dict[str, Any] = {"flatten_optimizer_state_dict": True}


def optimizer_state(module: nn.Module, optimizer: Optimizer, for_loading: bool = False) -> dict[str, Any]:
    """The optimizer's state dict keyed by parameter name, with each rank's shards. A ZeRO-1/2 optimizer gives its
    own rows as DTensors in the same flattened layout; ``for_loading`` makes sure its state exists to load into."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    if isinstance(optimizer, ZeroOptimizer):
        return optimizer.sharded_state_dict(_names(module), for_loading=for_loading)
    return get_optimizer_state_dict(module, optimizer, options=StateDictOptions(**_OPTIM_OPTIONS))


def load_optimizer_state(module: nn.Module, optimizer: Optimizer, state: dict[str, Any]) -> None:
    """Restores the optimizer from a state dict in the :func:`optimizer_state` format."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    if isinstance(optimizer, ZeroOptimizer):
        optimizer.load_sharded_state_dict(state, _names(module))
        return
    set_optimizer_state_dict(module, optimizer, state, options=StateDictOptions(**_OPTIM_OPTIONS))


def _names(module: nn.Module) -> dict[torch.Tensor, str]:
    return {param: name for name, param in module.named_parameters()}


# ---------------------------------------------------------------- what is on disk


def is_sharded_checkpoint(path: Path) -> bool:
    """Whether ``path`` is a complete par3d checkpoint (DCP's metadata and ``meta.pt``, which is written last)."""
    return path.is_dir() and (path / DCP_METADATA).is_file() and (path / METADATA_FILENAME).is_file()


def resolve_checkpoint(path: Path) -> Path:
    """``path``, or, if a save was killed between putting the old checkpoint aside and the new one in place, the
    previous checkpoint it left at ``.<name>.old``."""
    return atomic.resolve(path, is_sharded_checkpoint)


# ---------------------------------------------------------------- saving


class BackgroundSaves:
    """The saves of one engine that write in the background (``async_save=True``): at most one at a time.

    A save copies this rank's shards to CPU memory (DCP's staging) and returns to training while a thread writes
    them (``torch.distributed.checkpoint.async_save``, over :func:`~lightning_par3d.distributed.groups.
    checkpoint_group`). Rank 0 writes ``meta.pt`` into the staging directory at once; the staging directory takes
    the checkpoint's name only when every rank's shards are written (DCP's coordinator finishes after gathering every
    rank's write), on DCP's thread, and rank 0 holds the path's :class:`~lightning_par3d.checkpoint.atomic.SaveLock`
    until then. Until then the previous checkpoint stays at the name. The next save, a load, and the end of training
    wait for the save in flight first (:meth:`wait`), and raise its error if it failed."""

    def __init__(self, group: Callable[[], Any]) -> None:
        self.group = group
        self._future: Any = None
        self._in_place = threading.Event()
        self._in_place.set()
        self._lock = threading.Lock()
        self._after: list[Callable[[], None]] = []
        self._error: BaseException | None = None

    def start(self, future: Any, staging: Path, path: Path, lock: atomic.SaveLock | None) -> None:
        """Follows ``future`` (this rank's part of a save into ``staging``); with ``lock`` (rank 0, which holds the
        path's save lock): then puts the staging directory in place at ``path``, frees the lock, and runs what
        :meth:`after_in_place` queued."""
        self._future = future
        self._in_place.clear()

        def done(finished: Any) -> None:
            with self._lock:
                try:
                    if lock is not None and finished.exception() is None:
                        _swap_into_place(staging, path)
                        for then in self._after:
                            then()
                except BaseException as error:  # concurrent.futures drops what a done-callback raises: keep it
                    self._error = error
                finally:
                    if lock is not None:
                        lock.release()
                    self._after.clear()
                    self._in_place.set()

        future.add_done_callback(done)

    def after_in_place(self, then: Callable[[], None]) -> None:
        """Runs ``then`` once the save in flight has its name (at once if none is in flight), and not at all if it
        fails: the removal of an older checkpoint (``ModelCheckpoint``'s ``save_top_k``, right after a save
        returns) must not leave the run without a whole checkpoint while the new one is still being written."""
        with self._lock:
            if self._in_place.is_set():
                then()
            else:
                self._after.append(then)

    @property
    def in_flight(self) -> bool:
        return not self._in_place.is_set()

    def wait(self) -> None:
        """Blocks until the save in flight, if any, is written and in place; raises its error (the write's, or on
        rank 0 the rename's)."""
        future, self._future = self._future, None
        if future is not None:
            self._in_place.wait()
            future.result()
        error, self._error = self._error, None
        if error is not None:
            raise error


def save_sharded(
    path: Path,
    tensors: dict[str, Any],
    metadata: dict[str, Any],
    rank: int,
    per_rank: Callable[[Path], None] | None = None,
    background: BackgroundSaves | None = None,
) -> None:
    """Writes ``tensors`` with DCP (every rank its own shards) and ``metadata`` with ``torch.save`` (rank 0), into a
    staging directory of this save's own that then replaces ``path`` (:mod:`~lightning_par3d.checkpoint.atomic`:
    rank 0 holds the path's save lock throughout, so another job saving to it fails clearly, on every rank);
    ``per_rank(staging)`` writes each rank's own files first. With ``background``, the shards are written by a
    thread and the staging directory takes ``path`` when they are all written (:class:`BackgroundSaves`). Every
    rank must call it; an error of rank 0's (the lock, the staging directory, the swap) is raised on every rank."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    if path.is_file():
        raise FileExistsError(f"{path} is a file; a par3d checkpoint is a directory. Remove it or choose another path.")
    if background is not None:
        background.wait()  # one save at a time: the previous one whole and in place first
    lock = atomic.SaveLock(path) if rank == 0 else None
    staging = Path(on_rank_zero(lambda: _begin(path, lock), (atomic.CheckpointInUse,)))
    try:
        if per_rank is not None:  # before DCP's save, whose collectives order it before rank 0's meta.pt
            per_rank(staging)
        swapped = contiguous_copies(tensors)  # packed projections' interleaved shards, as contiguous blocks
        try:
            if background is not None:  # DCP copies the shards to CPU memory before it returns
                group = background.group()
                future = dcp.async_save(tensors, storage_writer=FileSystemWriter(staging), process_group=group)
            else:
                dcp.save(tensors, storage_writer=FileSystemWriter(staging))
        finally:
            put_back(swapped)
        if background is not None:
            if rank == 0:
                _write_file(staging / METADATA_FILENAME, lambda f: torch.save(metadata, f))
            background.start(future, staging, path, lock)
            lock = None  # the background save frees it once in place
            return

        def finish() -> None:
            _write_file(staging / METADATA_FILENAME, lambda f: torch.save(metadata, f))
            _swap_into_place(staging, path)

        on_rank_zero(finish)
    finally:
        if lock is not None:
            lock.release()


def _begin(path: Path, lock: atomic.SaveLock | None) -> str:
    """Rank 0's start of a save: the path's lock, what killed saves of it left removed, a previous checkpoint an
    interrupted swap left aside put back, and the staging directory made. Returns the staging directory."""
    assert lock is not None
    lock.acquire()
    for leftover in atomic.leftovers(path):
        shutil.rmtree(leftover, ignore_errors=True)
    _restore_previous(path)
    staging = atomic.staging_name(path)
    staging.mkdir(parents=True)
    return str(staging)


def _write_file(path: Path, write: Callable[[Any], None]) -> None:
    """Writes ``path`` completely or not at all (a temporary file, flushed to disk, then renamed)."""
    temporary = path.with_name(path.name + ".tmp")
    with open(temporary, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)


def _swap_into_place(staging: Path, path: Path) -> None:
    atomic.swap_into_place(staging, path)


def restore_previous_checkpoints(directory: Path) -> list[Path]:
    """Puts back, in ``directory``, each previous checkpoint that a save killed between its two renames left at
    ``.<name>.old`` while ``<name>`` is missing; returns the checkpoints put back. Every rank may run it at once:
    one rename wins, and the others find the checkpoint in place."""
    restored: list[Path] = []
    if not directory.is_dir():
        return restored
    for previous in sorted(directory.glob(".*.old")):
        path = directory / previous.name[1 : -len(".old")]
        if not path.exists() and is_sharded_checkpoint(previous):
            with contextlib.suppress(OSError):  # another rank put it back first
                os.rename(previous, path)
        if path.exists() and is_sharded_checkpoint(path):
            restored.append(path)
    return restored


def _restore_previous(path: Path) -> None:
    """Puts back a previous checkpoint that a killed save left aside."""
    atomic.restore_previous(path, is_sharded_checkpoint)


def remove_checkpoint(path: Path) -> None:
    """Removes a checkpoint directory (or file) and whatever an interrupted save of it left behind."""
    for candidate in (path, *atomic.leftovers(path), atomic.previous_name(path)):
        if candidate.is_dir():
            shutil.rmtree(candidate, ignore_errors=True)
        elif candidate.exists():
            candidate.unlink()


# ---------------------------------------------------------------- loading


def load_sharded(
    path: Path,
    module: nn.Module,
    optimizers: Mapping[str, Optimizer],
    model_key: str = "state_dict",
    strict: bool = True,
    weights_only: bool | None = None,
) -> dict[str, Any]:
    """Loads the model's and optimizers' shards in place (at the layout they were saved with or any other that DCP
    can reshard to) and returns the rest of the checkpoint (``meta.pt``). ``optimizers`` maps each optimizer's key
    in the checkpoint to it. The checkpoint is checked first, on every rank (:func:`check_checkpoint`): a missing,
    truncated or foreign checkpoint raises the same ``ValueError`` everywhere instead of failing inside a
    collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    path = resolve_checkpoint(path)
    state: dict[str, Any] = {model_key: model_state(module)}
    for key, optimizer in optimizers.items():
        state[key] = optimizer_state(module, optimizer, for_loading=True)
    metadata = check_checkpoint(path, {model_key: state[model_key]}, strict, weights_only)
    swapped = contiguous_copies(state)  # packed projections' interleaved shards, as contiguous blocks
    load_shards(state, path)
    copy_back(swapped)
    set_model_state_dict(module, state[model_key], options=StateDictOptions(strict=strict))
    for key, optimizer in optimizers.items():
        load_optimizer_state(module, optimizer, state[key])
    return metadata


def check_checkpoint(
    path: Path, expected: dict[str, dict[str, Any]], strict: bool = True, weights_only: bool | None = None
) -> dict[str, Any]:
    """Checks the checkpoint at ``path`` on every rank and agrees on the outcome; returns ``meta.pt``'s contents.

    Each rank checks that the directory is a complete checkpoint, that DCP's metadata reads, that every shard file
    it names exists and is long enough, that the tensors in ``expected`` (``{key: state_dict}``, this rank's) are
    in it with their global shapes, and that ``meta.pt`` loads. The ranks then exchange their findings (one
    collective), and every rank raises the same ``ValueError`` naming the files and what is wrong, if any rank
    found anything.
    """
    problems, metadata = _local_problems(path, expected, strict, weights_only)
    if dist.is_initialized():
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, problems)
        problems = list(dict.fromkeys(p for rank_problems in everyone for p in rank_problems))
    if problems:
        shown = "\n".join(f"  - {p}" for p in problems[:12])
        more = f"\n  (and {len(problems) - 12} more)" if len(problems) > 12 else ""
        raise ValueError(f"Cannot load the par3d checkpoint {path}:\n{shown}{more}")
    return metadata


def _local_problems(
    path: Path, expected: dict[str, dict[str, Any]], strict: bool, weights_only: bool | None
) -> tuple[list[str], dict[str, Any]]:
    if not path.is_dir():
        what = "a file" if path.exists() else "no such directory"
        hint = "; a save of it was interrupted" if atomic.leftovers(path) else ""
        return [f"{path} is not a par3d checkpoint ({what}{hint}). Pass the directory that par3d saved."], {}
    if not (path / DCP_METADATA).is_file():
        return [f"{path} is not a par3d checkpoint: {DCP_METADATA} (torch.distributed.checkpoint's) is missing."], {}
    if not (path / METADATA_FILENAME).is_file():
        return [f"{path / METADATA_FILENAME} is missing: the save of {path} did not complete."], {}
    try:
        dcp_metadata = read_metadata(path)
    except UnsafeCheckpointError as err:
        return [f"{path / DCP_METADATA} was refused, and nothing of it was run: {err}"], {}
    except Exception as err:
        if isinstance(err, EOFError) or "truncated" in str(err):
            return [f"{path / DCP_METADATA} is truncated: the save that wrote it did not complete."], {}
        return [f"{path / DCP_METADATA} cannot be read ({type(err).__name__}: {err}); the file is damaged."], {}
    problems = _shard_file_problems(path, dcp_metadata) + _key_problems(path, dcp_metadata, expected, strict)
    metadata: dict[str, Any] = {}
    try:
        metadata = load_file(path / METADATA_FILENAME, weights_only)
    except ValueError as err:
        problems.append(str(err))
    return problems, metadata


def _shard_file_problems(path: Path, metadata: Any) -> list[str]:
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    problems = []
    for name, length in sorted(needed.items()):
        file = path / name
        if not file.is_file():
            problems.append(f"shard file {file} is missing.")
        elif file.stat().st_size < length:
            problems.append(
                f"shard file {file} is truncated: {file.stat().st_size} bytes, but the checkpoint's metadata needs "
                f"{length}."
            )
    return problems


def _key_problems(path: Path, metadata: Any, expected: dict[str, dict[str, Any]], strict: bool) -> list[str]:
    saved = metadata.state_dict_metadata
    missing, mismatched = [], []
    for key, state in expected.items():
        for name, value in state.items():
            fqn = f"{key}.{name}"
            if fqn not in saved:
                missing.append(name)
            elif isinstance(value, torch.Tensor) and tuple(getattr(saved[fqn], "size", ())) != tuple(value.shape):
                mismatched.append(f"{name}: saved {tuple(saved[fqn].size)}, model {tuple(value.shape)}")
    problems = []
    if missing and strict:
        problems.append(
            f"{len(missing)} tensors of the model are not in {path} (e.g. {', '.join(missing[:4])}): it is another "
            "model's checkpoint, or was saved from a different model definition."
        )
    if mismatched:
        problems.append(
            f"{len(mismatched)} tensors have other shapes in {path} than in the model (e.g. "
            f"{'; '.join(mismatched[:3])}): it is another model's checkpoint."
        )
    return problems
