"""Par3DConfig's fields as typed keywords of every front-end (written once, in the dataclass; each front-end's signature
is derived from it by ``lightning_par3d.config.field_keywords``), and LightningCLI
end to end, as a user runs it: ``python examples/cli.py fit --trainer.strategy=lightning_par3d.Par3DStrategy ...``
on the real interpreter, whose Lightning launcher starts the second rank."""

from __future__ import annotations

import dataclasses
import inspect
import os
import subprocess
import sys
import typing
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from lightning_par3d import Par3DConfig, Par3DFabricStrategy, Par3DStrategy
from lightning_par3d.accelerate import Par3DAccelerator
from tests import background

ROOT = Path(__file__).resolve().parents[1]
FRONT_ENDS = [Par3DStrategy, Par3DFabricStrategy, Par3DAccelerator]
LAYOUT_LINE = "par3d: pp=1 × dp_replicate=1 × dp_shard=1 × tp=2 on 2 ranks"


def expected_parameter(f: dataclasses.Field) -> tuple[Any, Any]:
    """A field's (default, annotation) in a front-end's signature: the dataclass's, except that a list or dict field
    (``default_factory``) defaults to None, which stands for a fresh empty one."""
    hint = typing.get_type_hints(Par3DConfig)[f.name]
    return (f.default if f.default is not dataclasses.MISSING else None), hint


@pytest.mark.parametrize("front_end", FRONT_ENDS, ids=lambda c: c.__name__)
def test_every_config_field_is_a_typed_keyword_of_the_front_end(front_end):
    parameters = inspect.signature(front_end.__init__).parameters
    missing = [f.name for f in dataclasses.fields(Par3DConfig) if f.name not in parameters]
    assert not missing, f"{front_end.__name__}.__init__ lacks the Par3DConfig field(s) {', '.join(missing)}"
    for f in dataclasses.fields(Par3DConfig):
        parameter = parameters[f.name]
        assert parameter.kind is inspect.Parameter.KEYWORD_ONLY, f"{front_end.__name__}: {f.name} is not keyword-only"
        default, annotation = expected_parameter(f)
        got = (parameter.default, parameter.annotation)
        assert got == (default, annotation), (
            f"{front_end.__name__}: {f.name} is {got}, the dataclass says {default!r}, {annotation!r}"
        )
        assert type(parameter.default) is type(default), f"{front_end.__name__}: {f.name}'s default type differs"


def test_no_field_shares_a_name_with_the_base_classes_arguments():
    """Each keyword reaches one place: none of the fields is also an argument of Lightning's strategies or of
    ``accelerate.Accelerator`` (which ``Par3DAccelerator`` passes on as ``**kwargs``)."""
    from accelerate import Accelerator
    from lightning.fabric.strategies import ParallelStrategy as FabricParallelStrategy
    from lightning.pytorch.strategies import ParallelStrategy

    names = {f.name for f in dataclasses.fields(Par3DConfig)}
    for base in (ParallelStrategy, FabricParallelStrategy, Accelerator):
        assert not names & set(inspect.signature(base.__init__).parameters), base


@pytest.mark.parametrize("front_end", [Par3DStrategy, Par3DFabricStrategy], ids=lambda c: c.__name__)
def test_keywords_build_the_config_and_lists_are_never_shared(front_end):
    strategy = front_end(tp=2, split_points=["transformer.h.1"], tp_plan={"h.*.mlp.c_fc": "colwise"})
    assert strategy.config == Par3DConfig(tp=2, split_points=["transformer.h.1"], tp_plan={"h.*.mlp.c_fc": "colwise"})
    first, second = front_end(), front_end()
    first.config.split_points.append("transformer.h.2")
    first.config.tp_plan["lm_head"] = "colwise"
    assert second.config.split_points == [] and second.config.tp_plan == {}
    assert front_end(Par3DConfig(tp=2)).config.tp == 2


@pytest.mark.parametrize("front_end", [Par3DStrategy, Par3DFabricStrategy], ids=lambda c: c.__name__)
def test_config_and_settings_together_is_a_type_error(front_end):
    with pytest.raises(
        TypeError, match=rf"either a Par3DConfig or its fields to {front_end.__name__}.*got config and pp, tp"
    ):
        front_end(Par3DConfig(tp=2), tp=4, pp=2)
    with pytest.raises(TypeError, match="split_points"):
        front_end(Par3DConfig(), split_points=["transformer.h.1"])
    # A keyword left at its default is not a setting: a Hydra or LightningCLI caller passes every one.
    assert front_end(Par3DConfig(tp=2), tp=1, split_points=None).config.tp == 2


def test_accelerator_refuses_par3d_and_settings_together():
    with pytest.raises(TypeError, match="got par3d and tp"):
        Par3DAccelerator(par3d=Par3DConfig(), tp=2)


def test_accelerator_settings_beside_a_parallelism_config():
    """A ``ParallelismConfig`` gives dp_replicate, dp_shard and tp; the keywords add par3d's own fields, and may not
    give those three again."""
    from lightning_par3d.integrations.accelerate import _config

    parallelism = SimpleNamespace(dp_replicate_size=1, dp_shard_size=2, tp_size=2)
    names = {f.name for f in dataclasses.fields(Par3DConfig)}
    keywords = {n: p.default for n, p in inspect.signature(Par3DAccelerator).parameters.items() if n in names}
    config = _config(None, parallelism, {**keywords, "pp": 2, "zero_stage": 1})
    assert config == Par3DConfig(dp_shard=2, tp=2, pp=2, zero_stage=1)
    with pytest.raises(TypeError, match="got tp too"):
        _config(None, parallelism, {**keywords, "tp": 4})
    with pytest.raises(TypeError, match="either par3d= or parallelism_config="):
        _config(Par3DConfig(), parallelism, keywords)


# ---------------------------------------------------------------- LightningCLI as a user runs it
SMALL_RUN = [
    "--trainer.devices=2",
    "--trainer.accelerator=cpu",
    "--trainer.max_steps=2",
    "--trainer.limit_val_batches=0",
    "--trainer.enable_checkpointing=false",
    "--trainer.logger=false",
    "--trainer.enable_progress_bar=false",
    "--trainer.enable_model_summary=false",
    "--model.n_layer=1",
    "--model.n_embd=32",
    "--model.block_size=16",
    "--data.batch_size=4",
    "--data.max_bytes=4096",
]
CLI_TIMEOUT_S = 600  # a run takes about 20 s on 2 idle cores, 90 s beside other jobs; a hang ends at timeout_s=60


def run_cli(folder: Path, *args: str) -> tuple[Path, subprocess.CompletedProcess]:
    """``python examples/cli.py fit *args`` (small) from the repo root, its output folder ``folder``, as a background
    case (``tests/background.py``: it runs beside the pooled tests, its whole process group killed on a timeout)."""
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    command = [sys.executable, "examples/cli.py", "fit", *args, *SMALL_RUN, f"--trainer.default_root_dir={folder}"]
    return folder, background.run(command, timeout=CLI_TIMEOUT_S, cwd=ROOT, env=env)


STRATEGY_ON_THE_COMMAND_LINE = [
    "--trainer.strategy=lightning_par3d.Par3DStrategy",
    "--trainer.strategy.tp=2",
    "--trainer.strategy.timeout_s=60",
]
STRATEGY_IN_A_YAML = ["--config", "conf/cli/par3d_tp2.yaml", "--trainer.strategy.timeout_s=60"]
cli_command_line = background.fixture("cli_command_line", lambda folder: run_cli(folder, *STRATEGY_ON_THE_COMMAND_LINE))
cli_yaml = background.fixture("cli_yaml", lambda folder: run_cli(folder, *STRATEGY_IN_A_YAML))


def _check_cli_run(folder: Path, out: subprocess.CompletedProcess) -> None:
    output = out.stdout + out.stderr
    assert out.returncode == 0, output[-3000:]
    assert LAYOUT_LINE in output, output[-3000:]
    assert "`max_steps=2` reached" in output
    saved = (folder / "config.yaml").read_text()  # LightningCLI's record of the run: the strategy's init_args
    assert "class_path: lightning_par3d.Par3DStrategy" in saved and "tp: 2" in saved


def test_lightning_cli_trains_at_tp2_from_the_command_line(cli_command_line):
    _check_cli_run(*cli_command_line)


def test_lightning_cli_trains_at_tp2_from_a_yaml(cli_yaml):
    _check_cli_run(*cli_yaml)
