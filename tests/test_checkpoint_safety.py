"""Nothing par3d reads can run code: real checkpoints with a crafted ``.metadata``, ``meta.pt``, optimizer entry or
Accelerate object file are refused clearly on every path that reads a checkpoint (the reader itself, ``par3d
consolidate``, ``par3d export-hf``, the Trainer's resume, an elastic resume, Fabric's ``load``, Accelerate's
``load_state``), and no payload runs.

Each payload runs a command that creates a marker file; every test asserts the marker is absent after the refusal.
The payloads are live: plain ``pickle`` (torch's own DCP reader) runs them (the first tests show it), and the dotted
names resolve to ``os.system`` through modules the previous guard admitted whole.
"""

from __future__ import annotations

import argparse
import io
import os
import pickle
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_par3d.checkpoint import dcp, safe_reading
from lightning_par3d.checkpoint.consolidate import consolidate, read_whole
from tests.constants import MODEL, ONE_BATCH_EPOCHS


class _RunsACommand:
    """An object whose unpickling runs ``command`` (what a crafted checkpoint hides among real entries)."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (self.command,))


def _text(value: str) -> bytes:
    data = value.encode()
    return b"\x8c" + bytes([len(data)]) + data  # SHORT_BINUNICODE


def _calling(module: str, name: str, argument: str) -> bytes:
    """A protocol-4 pickle that resolves ``module``/``name`` (a dotted name, attribute by attribute) and calls it
    with ``argument``: PROTO 4, STACK_GLOBAL, TUPLE1, REDUCE."""
    return b"\x80\x04" + _text(module) + _text(name) + b"\x93" + _text(argument) + b"\x85R."


DOTTED = [  # the three modules the previous guard admitted whole, and the modules of the pairs admitted now
    ("torch.distributed.checkpoint.filesystem", "os.system"),
    ("torch.distributed.checkpoint.metadata", "torch.os.system"),
    ("torch.distributed.checkpoint.planner", "torch.os.system"),
    ("torch", "os.system"),
    ("torch.serialization", "shutil.os.system"),
    ("pathlib", "os.system"),
]
PLAIN = [("posix", "system"), ("os", "system"), ("subprocess", "getoutput")]
EVALUATING = [("builtins", "eval"), ("builtins", "exec")]


def _payloads(marker: Path) -> dict[str, bytes]:
    """Every crafted ``.metadata``, by name."""
    touch = f"touch {marker}"
    crafted = {f"{module}:{name}": _calling(module, name, touch) for module, name in DOTTED + PLAIN}
    for module, name in EVALUATING:
        crafted[f"{module}:{name}"] = _calling(module, name, f"open({str(marker)!r}, 'w')")
    return crafted


def _with_reduce_object(checkpoint: Path, marker: Path) -> bytes:
    """The checkpoint's own ``.metadata``, read as torch reads it, with an object whose ``__reduce__`` runs a
    command hidden in its storage record, pickled again."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(checkpoint).read_metadata()
    metadata.storage_meta.modules = [_RunsACommand(f"touch {marker}")]
    return pickle.dumps(metadata)


@pytest.fixture(scope="module")
def real_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint as par3d saves it (``save_sharded``, in this one process): the example GPT after an AdamW step,
    Lightning's entries in ``meta.pt``."""
    from examples.gpt import GPTModule

    torch.manual_seed(0)
    module = GPTModule(**MODEL)
    module.configure_model()
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
    tokens = torch.randint(0, 65, (2, MODEL["block_size"] + 1))
    module(tokens[:, :-1]).float().mean().backward()
    optimizer.step()
    path = tmp_path_factory.mktemp("real") / "last.ckpt"
    tensors = {"state_dict": dcp.model_state(module), "optimizer_0": dcp.optimizer_state(module, optimizer)}
    meta = {"epoch": 0, "global_step": 1, "hyper_parameters": dict(module.hparams)}
    with pytest.warns(UserWarning, match="torch.distributed is disabled"):
        dcp.save_sharded(path, tensors, meta, rank=0)
    return path


def _copy(checkpoint: Path, tmp_path: Path, name: str = "crafted.ckpt") -> Path:
    copy = tmp_path / name
    shutil.copytree(checkpoint, copy)
    return copy


# ---------------------------------------------------------------- the payloads are live


def test_the_dotted_names_reach_os_system_through_modules_the_previous_guard_admitted():
    for module, name in DOTTED:
        unpickler = pickle._Unpickler(io.BytesIO(b""))  # type: ignore[attr-defined]
        unpickler.proto = 4  # as the payload's PROTO opcode sets it
        assert unpickler.find_class(module, name) is os.system, (module, name)


def test_torchs_own_reader_runs_the_hidden_object(real_checkpoint, tmp_path):
    """What par3d's reader guards against: DCP's ``FileSystemReader`` unpickles ``.metadata`` with plain pickle."""
    from torch.distributed.checkpoint import FileSystemReader

    marker = tmp_path / "ran"
    crafted = _copy(real_checkpoint, tmp_path)
    (crafted / ".metadata").write_bytes(_with_reduce_object(real_checkpoint, marker))
    FileSystemReader(crafted).read_metadata()
    assert marker.exists()


# ---------------------------------------------------------------- the reader and the offline commands


def test_a_real_checkpoint_reads_and_consolidates_as_lightnings_consolidation_does(real_checkpoint, tmp_path):
    from lightning.fabric.utilities.load import _load_distributed_checkpoint

    ours = read_whole(real_checkpoint)
    theirs = _load_distributed_checkpoint(real_checkpoint)
    assert ours.keys() == theirs.keys() == {"state_dict", "optimizer_0", "epoch", "global_step", "hyper_parameters"}
    assert ours["state_dict"].keys() == theirs["state_dict"].keys()
    assert all(torch.equal(ours["state_dict"][k], theirs["state_dict"][k]) for k in theirs["state_dict"])
    assert ours["optimizer_0"].keys() == theirs["optimizer_0"].keys()
    for key, value in theirs["optimizer_0"].items():
        assert (
            torch.equal(ours["optimizer_0"][key], value)
            if isinstance(value, torch.Tensor)
            else ours["optimizer_0"][key] == value
        ), key
    written = consolidate(real_checkpoint, tmp_path / "one.pt")
    assert torch.load(written, weights_only=True)["global_step"] == 1
    with pytest.raises(FileExistsError, match="exists: choose another output file"):
        consolidate(real_checkpoint, written)


def _readers(tmp_path: Path) -> dict[str, Any]:
    """Every offline path that reads a checkpoint, each a function of the checkpoint's path that raises on a
    refusal (the commands return 2 and print the refusal: raised here with their output)."""
    from lightning_par3d.checkpoint.pretrained import read_checkpoint_model
    from lightning_par3d.tools.cli import main

    def command(*argv: str) -> None:
        err = io.StringIO()
        import contextlib

        with contextlib.redirect_stderr(err):
            code = main(list(argv))
        if code != 0:
            raise ValueError(err.getvalue())

    config = tmp_path / "config"
    if not config.exists():
        from transformers import LlamaConfig

        LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4).save_pretrained(
            config
        )
    return {
        "check_checkpoint": lambda path: dcp.check_checkpoint(path, {}),
        "read_checkpoint_model (export-hf)": lambda path: read_checkpoint_model(path),
        "par3d export-hf": lambda path: command("export-hf", str(path), str(tmp_path / "hf"), "--config", str(config)),
        "par3d consolidate": lambda path: command("consolidate", str(path), "--output_file", str(tmp_path / "c.pt")),
    }


def test_every_crafted_metadata_is_refused_on_every_offline_path_and_runs_nothing(real_checkpoint, tmp_path):
    marker = tmp_path / "ran"
    readers = _readers(tmp_path)
    crafted_files = {**_payloads(marker), "a __reduce__ object": _with_reduce_object(real_checkpoint, marker)}
    for kind, data in crafted_files.items():
        crafted = _copy(real_checkpoint, tmp_path, f"{kind.replace(':', '_').replace(' ', '_')}.ckpt")
        (crafted / ".metadata").write_bytes(data)
        for path_name, read in readers.items():
            with pytest.raises(ValueError) as refused:
                read(crafted)
            assert "which is not part of torch.distributed.checkpoint's metadata" in str(refused.value), (
                kind,
                path_name,
            )
            assert not marker.exists(), f"{kind} ran through {path_name}"


def test_a_crafted_meta_pt_is_refused_naming_the_global_and_the_safe_ways_on(real_checkpoint, tmp_path):
    marker = tmp_path / "ran"
    crafted = _copy(real_checkpoint, tmp_path)
    torch.save({"epoch": 0, "callbacks": _RunsACommand(f"touch {marker}")}, crafted / "meta.pt")
    for read in (lambda: dcp.check_checkpoint(crafted, {}), lambda: read_whole(crafted)):
        with pytest.raises(ValueError) as refused:
            read()
        message = str(refused.value)
        assert "meta.pt holds posix.system that loading it would import or call" in message
        assert "nothing of it was run" in message and "torch.serialization.add_safe_globals" in message
        assert "pass weights_only=False" in message and "Never do either for a checkpoint" in message
        assert "damaged" not in message and "truncated" not in message
    assert not marker.exists()


def test_the_two_ways_on_that_the_refusal_names_both_load_a_trusted_checkpoint(real_checkpoint, tmp_path):
    """Hyper-parameters of a type torch does not know (an ``argparse.Namespace``): refused by name; then loaded
    with the type allowed, or with ``weights_only=False``."""
    crafted = _copy(real_checkpoint, tmp_path)
    torch.save({"epoch": 0, "hyper_parameters": argparse.Namespace(lr=0.1)}, crafted / "meta.pt")
    with pytest.raises(ValueError, match=r"meta\.pt holds argparse\.Namespace that loading it"):
        dcp.check_checkpoint(crafted, {})
    with torch.serialization.safe_globals([argparse.Namespace]):
        assert dcp.check_checkpoint(crafted, {})["hyper_parameters"].lr == 0.1
    assert dcp.check_checkpoint(crafted, {}, weights_only=False)["hyper_parameters"].lr == 0.1


def test_a_truncated_metadata_or_meta_pt_is_reported_as_truncated(real_checkpoint, tmp_path):
    crafted = _copy(real_checkpoint, tmp_path)
    meta = crafted / "meta.pt"
    meta.write_bytes(meta.read_bytes()[:100])
    with pytest.raises(ValueError, match=r"meta\.pt is truncated \(100 bytes; its end is missing"):
        dcp.check_checkpoint(crafted, {})
    crafted = _copy(real_checkpoint, tmp_path, "short.ckpt")
    metadata = crafted / ".metadata"
    metadata.write_bytes(metadata.read_bytes()[:200])
    with pytest.raises(ValueError, match=r"\.metadata is truncated: the save that wrote it did not complete"):
        dcp.check_checkpoint(crafted, {})


def test_a_crafted_optimizer_entry_in_the_shards_is_refused(tmp_path):
    """A non-tensor entry (an optimizer's ``param_groups`` value) is pickled into the shard file: read with
    ``weights_only=True``, never run."""
    marker = tmp_path / "ran"
    path = tmp_path / "entry.ckpt"
    tensors = {
        "state_dict": {"w": torch.ones(2)},
        "optimizer_0": {"param_groups.w.lr": _RunsACommand(f"touch {marker}")},
    }
    with pytest.warns(UserWarning, match="torch.distributed is disabled"):
        dcp.save_sharded(path, tensors, {"epoch": 0}, rank=0)
    with pytest.raises(ValueError, match=r"entry optimizer_0\.param_groups\.w\.lr names globals that weights_only"):
        read_whole(path)
    assert not marker.exists()


def test_the_admitted_globals_are_exact_names_and_the_docs_list_them():
    assert all("." not in name for _, name in safe_reading.ADMITTED_GLOBALS)
    docs = (Path(__file__).parents[1] / "docs" / "training.md").read_text()
    for module, name in safe_reading.ADMITTED_GLOBALS:
        if module != "torch" or name == "Size":  # the dtypes are listed as "every torch dtype"
            assert f"`{module}.{name}`" in docs, f"{module}.{name} is admitted but not listed in docs/training.md"


# ---------------------------------------------------------------- every front-end's load


def _crafted_set(real: Path, folder: Path, marker: Path) -> dict[str, Path]:
    """A ``.metadata`` with a hidden object, and a ``meta.pt`` with one, each in a copy of ``real``."""
    metadata = _copy(real, folder, "metadata.ckpt")
    (metadata / ".metadata").write_bytes(_with_reduce_object(real, marker))
    meta = _copy(real, folder, "meta.ckpt")
    torch.save({"epoch": 0, "loops": _RunsACommand(f"touch {marker}")}, meta / "meta.pt")
    return {"metadata": metadata, "meta.pt": meta}


def _refusals(load: Any, paths: dict[str, str]) -> dict[str, str]:
    """Each crafted checkpoint through ``load``: the message it raised, or ``"loaded"``."""
    said = {}
    for kind, path in paths.items():
        try:
            load(path)
            said[kind] = "loaded"
        except Exception as error:  # the front-end's own exception, with the reader's message inside
            said[kind] = f"{type(error).__name__}: {error}"
    return said


def trainer_resumes(paths: dict[str, str], elastic: bool) -> dict[str, str]:
    from tests.gpt_runs import run_par3d

    strategy = dict(dp_shard=2, elastic=True) if elastic else dict(dp_shard=2)
    return _refusals(
        lambda path: run_par3d(strategy=strategy, devices=2, max_steps=2, data=ONE_BATCH_EPOCHS, resume_from=path),
        paths,
    )


def fabric_loads(paths: dict[str, str]) -> dict[str, str]:
    import lightning as L

    from examples.gpt import GPT, GPT_TP_PLAN, GPTConfig
    from lightning_par3d import Par3DFabricStrategy
    from tests.fabric_runs import FABRIC_MODEL

    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=Par3DFabricStrategy(dp_shard=2, tp_plan=GPT_TP_PLAN))
    fabric.launch()
    with fabric.init_module():
        model = GPT(GPTConfig(**FABRIC_MODEL))
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters()))
    return _refusals(lambda path: fabric.load(path, {"model": model, "optimizer": optimizer}), paths)


def accelerate_loads(paths: dict[str, str]) -> dict[str, str]:
    from tests.accelerate_runs import accelerate_loop

    return _refusals(lambda path: accelerate_loop(strategy=dict(dp_shard=2), steps=1, load_from=path), paths)


def _assert_refused(said: dict[str, str], marker: Path) -> None:
    assert not marker.exists(), said
    assert "which is not part of torch.distributed.checkpoint's metadata" in said["metadata"], said["metadata"]
    assert "meta.pt holds posix.system that loading it would import or call" in said["meta.pt"], said["meta.pt"]


@pytest.mark.parametrize("elastic", [False, True], ids=["resume", "elastic resume"])
def test_the_trainers_resume_refuses_crafted_checkpoints(pool2, real_checkpoint, tmp_path, elastic):
    marker = tmp_path / "ran"
    paths = {k: str(v) for k, v in _crafted_set(real_checkpoint, tmp_path, marker).items()}
    for said in pool2.run(trainer_resumes, paths=paths, elastic=elastic):
        _assert_refused(said, marker)


def test_fabrics_load_refuses_crafted_checkpoints(pool2, real_checkpoint, tmp_path):
    marker = tmp_path / "ran"
    paths = {k: str(v) for k, v in _crafted_set(real_checkpoint, tmp_path, marker).items()}
    for said in pool2.run(fabric_loads, paths=paths):
        _assert_refused(said, marker)


def test_accelerates_load_state_refuses_crafted_folders(pool2, tmp_path):
    """A real ``save_state`` folder; then copies with a crafted ``par3d/.metadata``, ``par3d/meta.pt``, and a
    registered object's file (which Accelerate itself loads with ``weights_only=False``)."""
    from tests.accelerate_runs import accelerate_loop

    real = tmp_path / "state"
    pool2.run(accelerate_loop, strategy=dict(dp_shard=2), steps=1, save_to=str(real))
    marker = tmp_path / "ran"
    paths = {}
    for kind, crafted in _crafted_set(real / "par3d", tmp_path, marker).items():
        folder = _copy(real, tmp_path, f"state-{kind}")
        shutil.rmtree(folder / "par3d")
        shutil.copytree(crafted, folder / "par3d")
        paths[kind] = str(folder)
    registered = _copy(real, tmp_path, "state-registered")
    torch.save({"step": _RunsACommand(f"touch {marker}")}, registered / "custom_checkpoint_0.pkl")
    paths["registered object"] = str(registered)
    for said in pool2.run(accelerate_loads, paths=paths):
        _assert_refused(said, marker)
        assert "custom_checkpoint_0.pkl holds posix.system" in said["registered object"], said["registered object"]
        assert "Accelerate loads it with weights_only=False" in said["registered object"]
