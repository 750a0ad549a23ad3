"""Every config in conf/ composes and instantiates through Hydra's compose API; bad overrides fail clearly."""

from __future__ import annotations

import tempfile
from pathlib import Path

import lightning as L
import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import ConfigCompositionException, InstantiationException
from hydra.utils import instantiate
from omegaconf import read_write

from examples.train import build_trainer
from lightning_par3d import Par3DStrategy
from lightning_par3d.integrations.hydra_schema import register_configs

CONF = Path(__file__).resolve().parents[1] / "conf"
LAUNCH_CONFIGS = "accelerate"  # conf/accelerate/: `accelerate launch --config_file` files, not a Hydra group
CLI_CONFIGS = "cli"  # conf/cli/: LightningCLI `--config` files (examples/cli.py), not a Hydra group
GROUPS = sorted(p.name for p in CONF.iterdir() if p.is_dir() and p.name not in (LAUNCH_CONFIGS, CLI_CONFIGS))


def compose_train(overrides: list[str]):
    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="train", overrides=overrides, return_hydra_config=True)
    # `${hydra:runtime.output_dir}` needs a running job; point it somewhere real for instantiation
    with read_write(cfg.hydra):
        cfg.hydra.runtime.output_dir = tempfile.mkdtemp(prefix="par3d-hydra-")
    from hydra.core.hydra_config import HydraConfig

    HydraConfig.instance().set_config(cfg)
    return cfg


def test_groups_are_the_documented_ones():
    assert GROUPS == ["callbacks", "data", "experiment", "logger", "model", "strategy", "trainer"]


@pytest.mark.parametrize(
    "override",
    [f"{group}={path.stem}" for group in GROUPS for path in sorted((CONF / group).glob("*.yaml"))],
)
def test_every_config_file_composes_and_instantiates(override):
    cfg = compose_train([override, "trainer.accelerator=cpu"])
    trainer = build_trainer(cfg)
    assert isinstance(trainer, L.Trainer)
    assert isinstance(trainer.strategy, Par3DStrategy)
    assert isinstance(instantiate(cfg.model), L.LightningModule)
    assert isinstance(instantiate(cfg.data), L.LightningDataModule)


def test_overrides_reach_the_strategy():
    cfg = compose_train(["strategy.tp=2", "strategy.dp_replicate=2", "trainer.devices=4"])
    trainer = build_trainer(cfg)
    assert str(trainer.strategy.layout) == "pp=1 × dp_replicate=2 × dp_shard=1 × tp=2"
    cfg = compose_train(["+strategy.tp_plan={lm_head: colwise_rep}"])
    assert build_trainer(cfg).strategy.config.tp_plan == {"lm_head": "colwise_rep"}


def test_demo_experiment_is_full_3d_on_8():
    trainer = build_trainer(compose_train(["experiment=demo"]))
    assert trainer.num_devices == 8
    assert str(trainer.strategy.layout) == "pp=2 × dp_replicate=1 × dp_shard=2 × tp=2"


def test_typo_in_a_field_fails_at_parse_time():
    with pytest.raises(ConfigCompositionException) as err:
        compose_train(["strategy.tpp=2"])
    assert "Key 'tpp' not in 'Par3DStrategyConf'" in str(err.value.__cause__)


def test_wrong_type_fails_at_parse_time():
    with pytest.raises(ConfigCompositionException) as err:
        compose_train(["strategy.tp=two"])
    assert "Value 'two' of type 'str' could not be converted to Integer" in str(err.value.__cause__)


def test_bad_value_fails_with_par3d_message():
    cfg = compose_train(["strategy.tp=3", "trainer.devices=4"])
    with pytest.raises(InstantiationException, match="needs the world size \\(4\\) to be divisible by"):
        build_trainer(cfg)


@pytest.mark.parametrize("name", ["cpu4", "gpu8"])
def test_accelerate_launch_configs_are_accelerate_configs(name):
    from accelerate.commands.config.config_args import load_config_from_file

    config = load_config_from_file(str(CONF / LAUNCH_CONFIGS / f"{name}.yaml"))
    assert config.distributed_type == "MULTI_GPU"  # N processes through torchrun (MULTI_CPU would start one)
    assert config.num_processes == {"cpu4": 4, "gpu8": 8}[name]


def test_accelerate_example_reads_the_apps_groups():
    from examples.accelerate_train import load_config, par3d_config

    GlobalHydra.instance().clear()
    cfg = load_config(["strategy.pp=2", "strategy.tp=2", "steps=3"])
    config = par3d_config(cfg, instantiate(cfg.model))
    assert (config.pp, config.tp, cfg.steps) == (2, 2, 3)
    assert config.tp_plan["lm_head"] == "colwise_rep"  # the example module's own plan
    GlobalHydra.instance().clear()
    cfg = load_config(["model=hf_llama", "model.pretrained_path=/some/dir"])
    config = par3d_config(cfg, instantiate(cfg.model))
    assert (config.tp_plan, config.init, config.pretrained_path) == ("auto", "pretrained", "/some/dir")


def test_an_advice_change_the_report_does_not_weigh_is_refused_before_anything_runs():
    """``mode=advise 'advise.change="..."'`` names a change the report weighs for the configured layout (the demo,
    pp=2: its microbatches among them); anything else is refused with that list before a process starts."""
    from examples.train import advise_and_verify, weighed_changes

    cfg = compose_train(["experiment=demo", "mode=advise", "advise.change=microbatches:3"])
    weighed = weighed_changes(cfg)
    assert weighed is not None and "microbatches=2" in weighed
    with pytest.raises(ValueError, match=r"advise.change='microbatches:3' is not a change .* 'microbatches=2'"):
        advise_and_verify(cfg)
    assert weighed_changes(compose_train(["strategy.layout=auto"])) is None  # the layout is chosen at launch
