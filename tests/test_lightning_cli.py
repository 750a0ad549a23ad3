"""Par3DConfig's fields as typed keywords of every front-end (written once, in the dataclass; each front-end's signature
is derived from it by ``lightning_par3d.config.field_keywords``), and LightningCLI
end to end, as a user runs it: ``python examples/cli.py fit --trainer.strategy=lightning_par3d.Par3DStrategy ...``
on the real interpreter, whose Lightning launcher starts the second rank."""

from __future__ import annotations

import dataclasses
import inspect
import typing
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from lightning_par3d import Par3DConfig, Par3DFabricStrategy, Par3DStrategy
from lightning_par3d.accelerate import Par3DAccelerator
from tests.test_docs import COMMANDS, documented  # noqa: F401  (the docs' runs, parametrized below)

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
    from lightning_par3d.integrations.accelerator import _config

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
CLI_COMMANDS = {
    "command line": "python examples/cli.py fit --trainer.strategy=lightning_par3d.Par3DStrategy "
    "--trainer.strategy.tp=2 --trainer.devices=2 --trainer.accelerator=cpu --trainer.max_steps=20",
    "yaml": "python examples/cli.py fit --config conf/cli/par3d_tp2.yaml --trainer.max_steps=20",
}
"""The LightningCLI commands the docs show (docs/front-ends.md, the README): their runs are the docs test's
(``tests/test_docs.py``, 3 steps each, in a folder of their own)."""


@pytest.mark.parametrize("documented", list(CLI_COMMANDS.values()), ids=list(CLI_COMMANDS), indirect=True)
def test_lightning_cli_trains_at_tp2_as_the_docs_show(documented):  # noqa: F811  (the fixture imported above)
    """The strategy from the command line, and from a YAML file: both train at tp=2 on 2 ranks, and LightningCLI's
    record of the run names the strategy's class and its init_args."""
    assert set(CLI_COMMANDS.values()) <= set(COMMANDS), "the docs no longer show these commands: update CLI_COMMANDS"
    folder, out = documented
    output = out.stdout + out.stderr
    assert out.returncode == 0, output[-3000:]
    assert LAYOUT_LINE in output, output[-3000:]
    assert "`max_steps=3` reached" in output
    [saved] = [p.read_text() for p in folder.rglob("config.yaml")]  # LightningCLI's record: the strategy's init_args
    assert "class_path: lightning_par3d.Par3DStrategy" in saved and "tp: 2" in saved
