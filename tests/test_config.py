"""Validation of the configuration: every bad value raises a ValueError that names it, before any process exists."""

from __future__ import annotations

import lightning as L
import pytest

from lightning_par3d import Layout, Par3DConfig, Par3DStrategy, resolve_layout


def layout_of(world_size: int, **fields: object) -> Layout:
    layout = resolve_layout(Par3DConfig(**fields), world_size)
    assert layout is not None
    return layout


@pytest.mark.parametrize(
    ("fields", "world", "expected"),
    [
        (dict(), 4, Layout(pp=1, dp_replicate=1, dp_shard=4, tp=1)),
        (dict(tp=2), 4, Layout(pp=1, dp_replicate=1, dp_shard=2, tp=2)),
        (dict(dp_replicate=2), 8, Layout(pp=1, dp_replicate=2, dp_shard=4, tp=1)),
        (dict(dp=4, dp_replicate=2, tp=2), 8, Layout(pp=1, dp_replicate=2, dp_shard=2, tp=2)),
        (dict(dp_replicate=4, dp_shard=1), 4, Layout(pp=1, dp_replicate=4, dp_shard=1, tp=1)),
        (dict(dp=2, dp_shard=2, tp=2), 4, Layout(pp=1, dp_replicate=1, dp_shard=2, tp=2)),
    ],
)
def test_resolves_sizes(fields, world, expected):
    assert layout_of(world, **fields) == expected


@pytest.mark.parametrize(
    ("fields", "world", "message"),
    [
        (dict(tp=0), 4, "tp=0 must be a positive integer"),
        (dict(tp=-2), 4, "tp=-2 must be a positive integer"),
        (dict(dp_replicate=0), 4, "dp_replicate=0 must be a positive integer"),
        (dict(dp_shard=0), 4, "dp_shard=0 must be a positive integer"),
        (dict(dp_shard="two"), 4, "dp_shard='two' must be a positive integer"),
        (dict(dp=-1), 4, "dp=-1 must be a positive integer"),
        (dict(pp=0), 4, "pp=0 must be a positive integer"),
        (dict(tp=3), 4, "dp_shard='auto' needs the world size (4) to be divisible by pp × dp_replicate × tp"),
        (dict(dp_shard=2, tp=3), 4, "= 6, but the world size (devices × num_nodes) is 4"),
        (dict(dp_replicate=2, dp_shard=2, tp=2), 4, "Change the sizes so that their product is 4"),
        (dict(dp=3, dp_replicate=2), 6, "dp=3 is not divisible by dp_replicate=2"),
        (dict(dp=2, dp_shard=4), 4, "dp=2 disagrees with dp_replicate × dp_shard = 1 × 4 = 4"),
        (dict(init="zeros"), 4, "init='zeros' is not an init mode. Allowed: 'rank0', 'meta'"),
        (dict(timeout_s=0), 4, "timeout_s=0 must be a positive number of seconds"),
        (dict(tp_plan={"h.*.mlp.c_fc": "columnwise"}), 4, "tp_plan['h.*.mlp.c_fc']='columnwise' is not a"),
        (dict(sequence_parallel=True), 4, "sequence_parallel=True splits the sequence over the tensor-parallel"),
        (dict(sequence_parallel="yes", tp=2), 4, "sequence_parallel='yes' must be True or False"),
    ],
)
def test_bad_values_name_the_value_and_the_fix(fields, world, message):
    with pytest.raises(ValueError, match="Invalid par3d configuration") as err:
        resolve_layout(Par3DConfig(**fields), world)
    assert message in str(err.value)


def test_all_problems_are_reported_together():
    with pytest.raises(ValueError) as err:
        resolve_layout(Par3DConfig(tp=0, pp=0, init="x"), 4)
    assert str(err.value).count("\n  - ") == 3


def test_strategy_validates_at_construction():
    with pytest.raises(ValueError, match="tp=0 must be a positive integer"):
        Par3DStrategy(tp=0)


def test_trainer_rejects_a_layout_that_does_not_fit_the_world_before_launching():
    """The launcher has not started any process when this raises: the check runs in `_configure_launcher`."""
    with pytest.raises(ValueError, match=r"= 6, but the world size \(devices × num_nodes\) is 4"):
        L.Trainer(accelerator="cpu", devices=4, strategy=Par3DStrategy(dp_shard=2, tp=3), logger=False)


def test_fabric_rejects_a_layout_that_does_not_fit_the_world_before_launching():
    from lightning_par3d import Par3DFabricStrategy

    with pytest.raises(ValueError, match="needs the world size \\(2\\) to be divisible"):
        L.Fabric(accelerator="cpu", devices=2, strategy=Par3DFabricStrategy(tp=4))


def test_config_and_fields_are_exclusive():
    from lightning_par3d import Par3DFabricStrategy

    for strategy in (Par3DStrategy, Par3DFabricStrategy):
        with pytest.raises(TypeError, match=f"fields to {strategy.__name__}, not both \\(got config and tp\\)"):
            strategy(Par3DConfig(), tp=2)


@pytest.mark.parametrize("precision", ["64-true", "16-true"])
def test_unsupported_precision_is_refused_clearly(precision):
    with pytest.raises(ValueError, match=f"par3d does not support precision='{precision}'. Choose among '32-true'"):
        L.Trainer(accelerator="cpu", devices=2, strategy="par3d", precision=precision, logger=False)


def test_registered_names():
    assert isinstance(L.Trainer(accelerator="cpu", devices=1, strategy="par3d", logger=False).strategy, Par3DStrategy)
    from lightning_par3d import Par3DFabricStrategy

    assert isinstance(L.Fabric(accelerator="cpu", devices=1, strategy="par3d").strategy, Par3DFabricStrategy)
