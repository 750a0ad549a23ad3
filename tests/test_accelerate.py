"""The Accelerate front-end: the README's loop through ``Par3DAccelerator`` trains to the single-process losses and
parameters at every layout, resumes at another layout, gathers evaluation outputs exactly, and refuses bad input
clearly."""

from __future__ import annotations

import functools

import pytest
import torch

from tests.accelerate_runs import accelerate_loop, single_process_loop
from tests.conftest import assert_parity
from tests.harness import RankError


@functools.cache
def reference(steps: int = 6, accumulate: int = 1, clip: float | None = None, n_layer: int = 2) -> dict:
    return single_process_loop(steps, accumulate, clip, n_layer)


@pytest.mark.parametrize(
    "strategy",
    [
        pytest.param(dict(dp_shard=2), id="dp_shard=2"),
        pytest.param(dict(tp=2), id="tp=2"),
        pytest.param(dict(pp=2), id="pp=2-1f1b"),
        pytest.param(dict(cp=2), id="cp=2"),
    ],
)
def test_accelerate_parity_two_ranks(pool2, strategy):
    assert_parity(pool2.run(accelerate_loop, strategy=strategy)[0], reference())


@pytest.mark.parametrize(
    "strategy",
    [
        pytest.param(dict(dp_shard=2, tp=2), id="dp2xtp2"),
        pytest.param(dict(dp_replicate=2, dp_shard=2), id="hsdp2x2"),
        pytest.param(dict(dp_replicate=4), id="ddp4"),
        pytest.param(dict(pp=2, tp=2), id="pp2xtp2"),
        pytest.param(dict(pp=2, dp_shard=2, zero_stage=1), id="pp2xdp2-zero1"),
    ],
)
def test_accelerate_parity_four_ranks(pool4, strategy):
    assert_parity(pool4.run(accelerate_loop, strategy=strategy)[0], reference())


def test_accelerate_parity_full_3d(pool8):
    assert_parity(pool8.run(accelerate_loop, strategy=dict(pp=2, dp_shard=2, tp=2))[0], reference())


def test_accelerate_accumulation_and_clipping(pool4):
    """gradient_accumulation_steps=2 and clipping at 0.5 (below the gradient norm throughout) at dp2×tp2."""
    got = pool4.run(accelerate_loop, strategy=dict(dp_shard=2, tp=2), accumulate=2, clip=0.5)[0]
    assert_parity(got, reference(accumulate=2, clip=0.5))


def test_accelerate_plain_backward_without_pipelining(pool4):
    """`loss = loss_fn(model(x), y); accelerator.backward(loss)` works unchanged at dp2×tp2."""
    assert_parity(pool4.run(accelerate_loop, strategy=dict(dp_shard=2, tp=2), plain_backward=True)[0], reference())


def test_accelerate_save_state_then_load_state_at_another_layout(pool4, tmp_path):
    """save_state after 3 steps at dp2×tp2, load_state at pp2×dp2, 3 more steps: the single-process trajectory."""
    path = str(tmp_path / "state")
    first = pool4.run(accelerate_loop, strategy=dict(dp_shard=2, tp=2), steps=3, save_to=path)[0]
    second = pool4.run(accelerate_loop, strategy=dict(pp=2, dp_shard=2), steps=6, start=3, load_from=path)[0]
    assert_parity({"losses": first["losses"] + second["losses"], "params": second["params"]}, reference())


def test_accelerate_bf16_mixed_precision_stays_close_to_fp32(pool4):
    got = pool4.run(accelerate_loop, strategy=dict(pp=2, tp=2), steps=5, mixed_precision="bf16")[0]
    ref = reference(steps=5)["losses"]
    relative = [abs(a - b) / b for a, b in zip(got["losses"], ref, strict=True)]
    assert max(relative) <= 1e-3, relative
    assert max(relative) > 0  # it did compute in bf16


def gather_job(strategy: dict, n: int) -> list[int]:
    """An evaluation pass over ``n`` numbered samples in batches of 8 per data-parallel rank (the last one padded by
    Accelerate where ``n`` does not fill it); the sample numbers ``gather_for_metrics`` returns."""
    from torch.utils.data import DataLoader, TensorDataset

    from examples.gpt import GPT, GPTConfig
    from tests.accelerate_runs import GPT_MODEL, _accelerator

    accelerator = _accelerator(strategy)
    with accelerator.init_empty_weights():
        model = GPT(GPTConfig(**GPT_MODEL))
    numbers = torch.arange(n)
    tokens = (numbers[:, None] * 7 + torch.arange(32)[None]) % 256
    loader = DataLoader(TensorDataset(tokens, numbers), batch_size=8)
    model, loader = accelerator.prepare(model, loader)
    seen: list[int] = []
    for x, number in loader:
        logits = accelerator.predict_step(model, x)  # under pp: on the last stage only
        mine = None if logits is None else (number, logits.argmax(-1)[:, 0])
        gathered = accelerator.gather_for_metrics(mine)
        seen += gathered[0].tolist()
    return seen


@pytest.mark.parametrize(
    ("strategy", "n"),
    [
        pytest.param(dict(pp=2, tp=2), 16, id="pp2xtp2"),
        pytest.param(dict(pp=2, dp_shard=2), 10, id="pp2xdp2-padded"),  # 2 batches over 2 ranks, the last padded
    ],
)
def test_gather_for_metrics_returns_the_eval_set_exactly(pool4, strategy, n):
    for seen in pool4.run(gather_job, strategy=strategy, n=n):
        assert seen == list(range(n))  # every sample once, in order, on every rank


def refusal_job(case: str) -> str:
    from examples.gpt import GPT, GPTConfig
    from tests.accelerate_runs import GPT_MODEL, _accelerator

    if case == "fsdp plugin":
        from accelerate.utils import FullyShardedDataParallelPlugin

        try:
            _accelerator(dict(dp_shard=2), fsdp_plugin=FullyShardedDataParallelPlugin())
        except ValueError as err:
            return str(err)
        return ""
    accelerator = _accelerator(dict(pp=2) if case in ("backward under pp", "no loss under pp") else dict(dp_shard=2))
    with accelerator.init_empty_weights():
        model = GPT(GPTConfig(**{**GPT_MODEL, "n_layer": 2}))
    before = list(model.parameters())
    prepared = accelerator.prepare(model)
    x = torch.zeros(4, 32, dtype=torch.long)
    try:
        if case == "prepare twice":
            accelerator.prepare(model)
        elif case == "stale optimizer":
            accelerator.prepare(torch.optim.AdamW(before))
        elif case == "backward under pp":
            accelerator.backward(torch.zeros((), requires_grad=True))
        elif case == "no loss under pp":
            accelerator.train_step(prepared, x, x, None)  # type: ignore[arg-type]
    except (RuntimeError, ValueError, TypeError) as err:
        return f"{type(err).__name__}: {err}"
    return ""


@pytest.mark.parametrize(
    ("case", "says"),
    [
        ("fsdp plugin", "cannot run together with fsdp_plugin"),
        ("prepare twice", "has been prepared already"),
        ("stale optimizer", "was created over the model's parameters as they were before `prepare`"),
        ("backward under pp", "replace `loss = loss_fn(model(x), y); accelerator.backward(loss)`"),
        ("no loss under pp", "train_step needs the loss function"),
    ],
)
def test_bad_input_is_a_clear_error_on_every_rank(pool2, case, says):
    messages = pool2.run(refusal_job, case=case)
    assert all(says in m for m in messages), messages


def test_parallelism_config_maps_cp_and_ulysses_is_refused():
    from accelerate.parallelism_config import ParallelismConfig

    from lightning_par3d import Par3DConfig

    config = Par3DConfig.from_accelerate(ParallelismConfig(dp_replicate_size=2, dp_shard_size=2, tp_size=2), pp=2)
    assert (config.dp_replicate, config.dp_shard, config.tp, config.pp, config.cp) == (2, 2, 2, 2, 1)
    config = Par3DConfig.from_accelerate(ParallelismConfig(dp_shard_size=2, cp_size=2))
    assert (config.dp_shard, config.cp) == (2, 2)
    with pytest.raises(ValueError, match=r"Ulysses sequence parallelism \(sp_size=2\)"):
        Par3DConfig.from_accelerate(ParallelismConfig(dp_shard_size=2, sp_size=2))


def test_rank_error_is_raised_for_a_bad_layout(pool2):
    with pytest.raises(RankError) as err:
        pool2.run(accelerate_loop, strategy=dict(tp=3))
    assert "divisible by pp × dp_replicate × tp" in err.value.exc_message


@pytest.mark.parametrize(
    "strategy",
    [pytest.param(dict(pp=2, tp=2), id="pp2xtp2"), pytest.param(dict(dp_shard=2, tp=2), id="dp2xtp2")],
)
def test_fabric_and_accelerate_run_the_same_script_to_the_same_losses(pool4, strategy):
    """One script, two front-ends over one engine: the per-step losses agree to 1e-6 and the parameters to 1e-6
    (and both match one process)."""
    from tests.accelerate_runs import fabric_loop

    fabric = pool4.run(fabric_loop, strategy=strategy, clip=0.5)[0]
    accelerate = pool4.run(accelerate_loop, strategy=strategy, clip=0.5)[0]
    torch.testing.assert_close(torch.tensor(fabric["losses"]), torch.tensor(accelerate["losses"]), rtol=1e-6, atol=0)
    for name, value in accelerate["params"].items():
        torch.testing.assert_close(fabric["params"][name], value, rtol=1e-6, atol=1e-7, msg=name)
    assert_parity(fabric, reference(clip=0.5))
