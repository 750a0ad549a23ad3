"""The engine on its own: a plain torch training loop, no Lightning, trains to the single-process losses and
parameters at dp2×tp2 and pp2×tp2, and the engine's contracts (reuse, refusal, optimizer re-pointing) hold."""

from __future__ import annotations

import functools
import itertools
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from examples.data import ShakespeareDataModule
from examples.fabric_train import gpt_loss
from examples.gpt import GPT, GPT_TP_PLAN, GPTConfig
from tests.conftest import assert_parity
from tests.gpt_runs import DATA, GLOBAL_BATCH, MODEL, SEED, full_state

GPT_MODEL = {k: v for k, v in MODEL.items() if k not in ("lr", "eps")}


def plain_loop(strategy: dict[str, Any] | None, steps: int = 6, clip: float | None = None, n_layer: int = 2) -> dict:
    """The same loop with and without par3d: seed, build, (parallelize), AdamW, ``steps`` steps over seeded
    shuffled batches of ``GLOBAL_BATCH`` samples split over the data-parallel ranks."""
    from lightning_par3d import Par3DConfig, Par3DEngine

    engine = None
    if strategy is not None:
        engine = Par3DEngine(Par3DConfig(tp_plan=GPT_TP_PLAN, timeout_s=120, **strategy))
        engine.setup(torch.device("cpu"))
    torch.manual_seed(SEED)
    with engine.init_context() if engine is not None else torch.device("cpu"):
        model: torch.nn.Module = GPT(GPTConfig(**{**GPT_MODEL, "n_layer": n_layer}))
    trained = engine.parallelize(model) if engine is not None else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=MODEL["lr"], weight_decay=0.1, betas=(0.9, 0.95), eps=1e-6)
    if engine is not None:
        [optimizer] = engine.setup_optimizers([optimizer])  # built before parallelize: pointed at the shards
    data = ShakespeareDataModule(**DATA)
    data.setup()
    split = engine.sampler_kwargs() if engine is not None else {"num_replicas": 1, "rank": 0}
    sampler = DistributedSampler(data.train_set, shuffle=True, seed=SEED, **split)
    loader = DataLoader(data.train_set, GLOBAL_BATCH // split["num_replicas"], sampler=sampler)
    losses = []
    for x, y in itertools.islice(loader, steps):
        if engine is None:
            loss = gpt_loss(trained(x), y)
            loss.backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        else:
            loss = engine.train_step(trained, x, y, gpt_loss)
            if clip is not None:
                engine.clip_grad_norm_(optimizer, clip)
            loss = engine.reduce(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    params = full_state(model)
    if engine is not None:
        engine.teardown()
    return {"losses": losses, "params": params}


@functools.cache
def reference(clip: float | None, n_layer: int) -> dict:
    return plain_loop(None, clip=clip, n_layer=n_layer)


@pytest.mark.parametrize(
    ("strategy", "clip", "n_layer"),
    [
        pytest.param(dict(dp_shard=2, tp=2), None, 2, id="dp2xtp2"),
        pytest.param(dict(pp=2, tp=2), 0.5, 4, id="pp2xtp2-clip"),
    ],
)
def test_a_plain_torch_loop_over_the_engine_matches_one_process(pool4, strategy, clip, n_layer):
    got = pool4.run(plain_loop, strategy=strategy, clip=clip, n_layer=n_layer)[0]
    assert_parity(got, reference(clip, n_layer))


def reuse_job() -> dict:
    """Parallelizes a model, then parallelizes the same model again (a second engine, as a second fit does), and
    once more at another layout."""
    from lightning_par3d import Par3DConfig, Par3DEngine

    first = Par3DEngine(Par3DConfig(dp_shard=2, tp_plan=GPT_TP_PLAN, timeout_s=120))
    first.setup(torch.device("cpu"))
    with first.init_context():
        model = GPT(GPTConfig(**GPT_MODEL))
    trained = first.parallelize(model)
    second = Par3DEngine(Par3DConfig(dp_shard=2, tp_plan=GPT_TP_PLAN, timeout_s=120))
    second.setup(torch.device("cpu"))
    same = second.parallelize(model) is trained
    other = Par3DEngine(Par3DConfig(dp_shard=1, dp_replicate=2, tp_plan=GPT_TP_PLAN, timeout_s=120))
    other.setup(torch.device("cpu"))
    try:
        other.parallelize(model)
    except ValueError as err:
        return {"same": same, "error": str(err)}
    return {"same": same, "error": None}


def test_a_parallelized_model_is_reused_and_another_layout_refused(pool2):
    got = pool2.run(reuse_job)[0]
    assert got["same"]
    assert got["error"] is not None
    assert "already parallelized by par3d with other settings" in got["error"]
    assert "layout then: pp=1 × dp_replicate=1 × dp_shard=2 × tp=1 (ZeRO-3)" in got["error"]
    assert "Build a fresh model for the new layout" in got["error"]


def stale_optimizer_job() -> str:
    from lightning_par3d import Par3DConfig, Par3DEngine

    engine = Par3DEngine(Par3DConfig(dp_shard=2, timeout_s=120))
    engine.setup(torch.device("cpu"))
    with engine.init_context():
        model = GPT(GPTConfig(**GPT_MODEL))
    engine.parallelize(model)
    stranger = torch.nn.Parameter(torch.zeros(3))
    try:
        engine.setup_optimizers([torch.optim.AdamW([stranger])])
    except ValueError as err:
        return str(err)
    return ""


def test_an_optimizer_over_foreign_tensors_is_refused(pool2):
    message = pool2.run(stale_optimizer_job)[0]
    assert "holds a tensor of shape (3,) that is not a parameter of the parallelized model" in message


def test_the_engine_validates_before_any_process_group():
    from lightning_par3d import Par3DConfig, Par3DEngine

    engine = Par3DEngine(Par3DConfig(tp=3))
    with pytest.raises(ValueError, match=r"divisible by pp × dp_replicate × tp = 1 × 1 × 3 = 3"):
        engine.resolve(world_size=4)
    with pytest.raises(ValueError, match="par3d does not support precision='64-true'"):
        Par3DEngine(Par3DConfig(), precision="64-true")
    with pytest.raises(RuntimeError, match=r"call Par3DEngine\.resolve"):
        _ = Par3DEngine(Par3DConfig()).layout


def timeout_job() -> list[float]:
    """The default group's and a mesh sub-group's collective timeouts after an engine's setup, in seconds."""
    import torch.distributed as dist

    from lightning_par3d import Par3DConfig, Par3DEngine
    from lightning_par3d.utils.torch_private import default_store

    def seconds(group: dist.ProcessGroup) -> float:
        return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()

    # A timeout no other test uses: this worker keeps one more (bounded, one-off) mesh for it.
    engine = Par3DEngine(Par3DConfig(dp_shard=2, timeout_s=77))
    engine.setup(torch.device("cpu"))
    mesh = engine.mesh
    store = default_store()  # private in torch: lightning_par3d.utils.torch_private says why
    return [seconds(dist.group.WORLD), seconds(mesh["dp"].get_group()), store.timeout.total_seconds()]


def test_every_collective_gets_the_configured_timeout(pool2):
    """The default group was created by the pool, with another timeout: setup gives it, its store and the mesh's
    groups ``timeout_s``, which is also what a stalled peer is caught by."""
    assert pool2.run(timeout_job) == [[77.0, 77.0, 77.0]] * 2
