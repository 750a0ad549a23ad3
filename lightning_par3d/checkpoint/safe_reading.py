"""Reading a checkpoint without running anything in it: what par3d reads from disk, and the one rule for each file.

A checkpoint directory comes from wherever the user got it (a colleague, a bucket, the hub), so loading it must not
run code. Pickle runs code: its ``GLOBAL`` opcodes import any callable by name and ``REDUCE`` calls it. par3d reads:

* **DCP's** ``.metadata``, with :class:`MetadataUnpickler`: it resolves exactly the ``(module, name)`` pairs of
  :data:`ADMITTED_GLOBALS` (DCP's own metadata dataclasses, torch's dtypes and ``Size``, a layout by name, and
  ``pathlib``'s paths), and refuses every other global, every dotted name and every module-wide allowance. A dotted
  name is how the last version of this guard was beaten: pickle protocol 4 resolves ``os.system`` inside
  ``torch.distributed.checkpoint.filesystem`` (which imports ``os``), so a check by module let it through.
  torch's own ``FileSystemReader.read_metadata`` uses plain ``pickle.load``: loading a par3d checkpoint through
  par3d (Trainer resume, Fabric ``load``, ``Par3DAccelerator.load_state``, ``par3d export-hf``, ``par3d
  consolidate``, an elastic resume) is safer than loading it with ``torch.distributed.checkpoint.load``.
* **DCP's shard files**: tensors through torch's ``torch.load(..., weights_only=True)`` (DCP's reader), non-tensor
  entries (optimizer hyper-parameters) through ours with ``weights_only=True``.
* ``meta.pt`` (Lightning's loops, callbacks, hyper-parameters) and ``rng/rank<r>.pt``: :func:`load_file`, with the
  ``weights_only`` the caller passes (torch's default, ``True``, when None; Lightning's ``trainer.fit(...,
  weights_only=...)``). A refusal names the global refused and the two safe ways on; a truncated file says so.
* Accelerate's ``custom_checkpoint_<i>.pkl`` (``accelerator.register_for_checkpointing``), which Accelerate itself
  loads with ``weights_only=False``: :func:`refuse_unsafe_pickles` checks it first, and refuses a file that names
  a global ``weights_only=True`` would not load (torch's ``get_unsafe_globals_in_checkpoint``).
"""

from __future__ import annotations

import io
import itertools
import pickle
import zipfile
from pathlib import Path
from typing import Any

import torch

DCP_METADATA = ".metadata"

_DCP_METADATA_CLASSES = (
    "Metadata",
    "StorageMeta",
    "MetadataIndex",
    "TensorStorageMetadata",
    "BytesStorageMetadata",
    "ChunkStorageMetadata",
    "TensorProperties",
    "_MEM_FORMAT_ENCODING",
)
ADMITTED_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    {("torch.distributed.checkpoint.metadata", name) for name in _DCP_METADATA_CLASSES}
    | {("torch.distributed.checkpoint.filesystem", "_StorageInfo")}
    | {("torch", "Size"), ("torch.serialization", "_get_layout")}  # torch.strided & co. by name, as weights_only does
    | {("torch", name) for name in dir(torch) if isinstance(getattr(torch, name, None), torch.dtype)}
    | {(module, name) for module in ("pathlib", "pathlib._local") for name in ("Path", "PosixPath", "WindowsPath")}
)
"""Every global DCP's ``.metadata`` may name, as exact ``(module, name)`` pairs (``pathlib._local`` is where Python
3.13 defines the paths). Each is a dataclass of DCP's, a torch dtype or ``Size``, torch's lookup of a layout by its
name, or a path: building any of them runs no code of the file's choosing."""


class UnsafeCheckpointError(ValueError):
    """A checkpoint file names something that reading it would import or run; nothing of it was run."""


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata``: the globals of :data:`ADMITTED_GLOBALS`, each by its exact name, and nothing
    else (see the module docstring)."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in ADMITTED_GLOBALS:
            raise UnsafeCheckpointError(
                f"it names the global {module}.{name}, which is not part of torch.distributed.checkpoint's metadata; "
                "par3d reads only DCP's own metadata classes from it, and refuses to import or call anything else "
                "(a crafted or foreign file)."
            )
        return super().find_class(module, name)


def read_metadata(path: Path) -> Any:
    """DCP's metadata of the checkpoint directory ``path``, read by :class:`MetadataUnpickler`: nothing it names
    beyond :data:`ADMITTED_GLOBALS` is imported or called."""
    with open(path / DCP_METADATA, "rb") as f:
        return MetadataUnpickler(f).load()


def load_file(path: Path, weights_only: bool | None, what: str = "") -> Any:
    """``torch.load(path, weights_only=weights_only)`` on the CPU, with errors a person can act on: a refusal of
    ``weights_only`` names the globals it refused and the two safe ways on; a truncated or damaged file says which.
    Raises ``ValueError`` (``UnsafeCheckpointError`` for a refusal)."""
    try:
        return torch.load(path, map_location="cpu", weights_only=weights_only)
    except pickle.UnpicklingError as error:
        if "weights_only" not in str(error).lower() and "weights only" not in str(error).lower():
            raise ValueError(f"{path} cannot be read: {_first_line(error)}; the file is damaged.") from error
        raise UnsafeCheckpointError(_refusal(path, what)) from error
    except (RuntimeError, EOFError, OSError) as error:
        raise ValueError(_damage(path, error)) from error


def refuse_unsafe_pickles(paths: list[Path]) -> None:
    """Raises ``UnsafeCheckpointError`` for the first file of ``paths`` (files ``torch.save`` wrote, which another
    library then loads with ``weights_only=False``) that names a global ``weights_only=True`` would not load."""
    for path in paths:
        if path.is_file() and _unsafe_globals(path):
            raise UnsafeCheckpointError(_refusal(path, "Accelerate loads it with weights_only=False"))


def _unsafe_globals(path: Path) -> list[str]:
    """The globals of the ``torch.save`` file ``path`` that ``weights_only=True`` refuses (torch's safe globals,
    those added with ``torch.serialization.add_safe_globals`` included); every global of a file that is not a
    ``torch.save`` zip, as torch reads those with the legacy format's plain unpickler."""
    try:
        return list(torch.serialization.get_unsafe_globals_in_checkpoint(str(path)))
    except (RuntimeError, ValueError, zipfile.BadZipFile):
        return ["(a file torch cannot check: not a torch.save archive)"]


def _refusal(path: Path, why: str) -> str:
    named = _unsafe_globals(path)
    shown = ", ".join(named[:6]) + (f" (and {len(named) - 6} more)" if len(named) > 6 else "")
    return (
        f"{path} holds {shown or 'globals'} that loading it would import or call{f' ({why})' if why else ''}, and "
        "par3d loads only what torch's weights_only=True allows: nothing of it was run. If you trust where this "
        "checkpoint came from, either allow those types (torch.serialization.add_safe_globals([...]) before loading, "
        "for classes you know), or, for this checkpoint only, pass weights_only=False (Lightning: "
        "trainer.fit(..., ckpt_path=..., weights_only=False); Fabric: fabric.load(..., weights_only=False)). Never "
        "do either for a checkpoint from a source you do not trust."
    )


def _damage(path: Path, error: BaseException) -> str:
    size = path.stat().st_size if path.is_file() else 0
    text = _first_line(error)
    if not path.is_file():
        return f"{path} is missing."
    if isinstance(error, EOFError) or "central directory" in text or "zip archive" in text or size == 0:
        return (
            f"{path} is truncated ({size} bytes; its end is missing: {text}). The save that wrote it did not "
            "complete: load the checkpoint before it."
        )
    return f"{path} cannot be loaded ({type(error).__name__}: {text}); the file is damaged."


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__


def _safe_reader_class() -> type:
    from torch.distributed.checkpoint import FileSystemReader

    class _SafeFileSystemReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata = read_metadata(Path(self.path))
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return _SafeFileSystemReader


def load_shards(state: dict[str, Any], path: Path, **options: Any) -> None:
    """``torch.distributed.checkpoint.load`` of ``state`` from the checkpoint directory ``path``, through par3d's
    reader and planner. A refusal on any rank is raised as the :class:`UnsafeCheckpointError` itself (DCP wraps what
    its readers raise in a ``CheckpointException``, a ``BaseException`` naming only the ranks)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        dcp.load(state, storage_reader=SafeFileSystemReader(path), planner=safe_load_planner(), **options)
    except CheckpointException as error:
        refused = [e for e, _ in error.failures.values() if isinstance(e, UnsafeCheckpointError)]
        if refused:
            raise refused[0] from None
        raise


def SafeFileSystemReader(path: Path) -> Any:
    """DCP's ``FileSystemReader`` whose metadata is read by :func:`read_metadata`."""
    return _safe_reader_class()(path)


def safe_load_planner() -> Any:
    """DCP's default load planner, with non-tensor entries read by ``torch.load(..., weights_only=True)``."""
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class _Planner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            try:
                obj = torch.load(value, weights_only=True)
            except pickle.UnpicklingError as error:
                raise UnsafeCheckpointError(
                    f"the checkpoint's entry {read_item.dest_index.fqn} names globals that weights_only=True does "
                    f"not load ({_first_line(error)}); nothing of it was run."
                ) from error
            if self.flatten_state_dict:
                set_at_path(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    return _Planner()


def set_at_path(root: dict[str, Any], path: tuple[str | int, ...], value: Any) -> None:
    """Puts ``value`` in the nested state dict ``root`` at ``path`` (keys of dicts, indices of lists, as DCP's
    flattening mappings give them), creating the containers on the way: a dict before a string key, a list (grown
    with ``None``) before an index. What ``DefaultLoadPlanner.load_bytes`` does with a private helper of DCP."""
    container: Any = root
    for key, following in itertools.pairwise(path):
        empty: Any = {} if isinstance(following, str) else []
        if isinstance(container, dict):
            container = container.setdefault(key, empty)
        else:
            assert isinstance(key, int), f"a list indexed by {key!r} in the path {path}"
            container.extend([None] * (key + 1 - len(container)))
            if container[key] is None:
                container[key] = empty
            container = container[key]
    last = path[-1]
    if isinstance(last, int):
        container.extend([None] * (last + 1 - len(container)))
    container[last] = value
