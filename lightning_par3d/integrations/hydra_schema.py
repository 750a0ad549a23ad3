"""Hydra structured config for the strategy, so that ``strategy.tp=two`` or ``strategy.tpp=2`` fails at parse time
with Hydra's own message, and ``instantiate(cfg.strategy)`` builds a :class:`~lightning_par3d.Par3DStrategy`."""

from __future__ import annotations

from dataclasses import dataclass

from lightning_par3d.config import Par3DConfig


@dataclass
class Par3DStrategyConf(Par3DConfig):
    """:class:`Par3DConfig` plus Hydra's ``_target_``: the schema of ``conf/strategy/par3d.yaml``."""

    _target_: str = "lightning_par3d.Par3DStrategy"


def register_configs() -> None:
    """Stores the schema in Hydra's ConfigStore as ``strategy/par3d_schema``. Call it before ``@hydra.main``."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(group="strategy", name="par3d_schema", node=Par3DStrategyConf)
