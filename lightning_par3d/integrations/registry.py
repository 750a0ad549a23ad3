"""``"par3d"`` in Lightning's strategy registries: each front-end calls its function at the end of its module
(:mod:`lightning_par3d.registration` imports the front-ends once Lightning is imported)."""

from __future__ import annotations

DESCRIPTION = "par3d: data (ZeRO 0-3, HSDP) × tensor (DTensor) × pipeline parallel, from one config"


def register_trainer_strategy(strategy: type) -> None:
    """``Trainer(strategy="par3d")`` → ``strategy``, unless "par3d" is taken already."""
    from lightning.pytorch.strategies import StrategyRegistry

    if "par3d" not in StrategyRegistry:
        StrategyRegistry.register("par3d", strategy, description=DESCRIPTION)


def register_fabric_strategy(strategy: type) -> None:
    """``Fabric(strategy="par3d")`` → ``strategy``, unless "par3d" is taken already."""
    from lightning.fabric.strategies import STRATEGY_REGISTRY

    if "par3d" not in STRATEGY_REGISTRY:
        STRATEGY_REGISTRY.register("par3d", strategy, description=DESCRIPTION)
