"""``compile=True`` and ``trainer.fit(torch.compile(module))`` on CPU processes: each block compiled in place, at the
losses of one eager process, with no recompilation after the first step (dynamo's own graph count), and parameter
names free of ``_orig_mod``. Torch's default backend (inductor, generating C++ on CPU) at dp_shard=2; the layouts
with tp and pp, and the two ways of asking, traced by dynamo and AOTAutograd (``aot_eager``: what par3d's hooks and
DTensors meet), since inductor compiles for tens of seconds per case on two cores."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

from tests.conftest import assert_parity
from tests.constants import ONE_BATCH_EPOCHS
from tests.gpt_runs import run_reference

TRACE = {"backend": "aot_eager"}
TRACED = dict(compile=True, compile_options=TRACE)


def compiled_job(strategy: dict[str, Any], devices: int, how: str, max_steps: int = 4) -> dict[str, Any]:
    """A run compiled ``how``: ``"compile=True"`` on the strategy, or ``"torch.compile"``, the user's
    ``trainer.fit(torch.compile(module))``. Adds how many of this rank's modules are compiled, and whether any
    parameter name holds ``_orig_mod``."""
    from lightning_par3d.parallel.compile import is_compiled
    from tests.compile_runs import run_compiled

    if how == "compile=True":
        strategy = {**strategy, "compile": True, "compile_options": TRACE}
        result = run_compiled(strategy, devices, keep_module=True, max_steps=max_steps)
    else:
        result = run_compiled(strategy, devices, keep_module=True, max_steps=max_steps, torch_compile=TRACE)
    module = result.pop("module")
    result["compiled"] = [name for name, sub in module.named_modules() if is_compiled(sub)]
    result["orig_mod_names"] = [name for name, _ in module.named_parameters() if "_orig_mod" in name]
    result["step_methods_compiled"] = getattr(module, "_compiler_ctx", None) is not None
    return result


LAYOUTS = [
    pytest.param(dict(dp_shard=2, tp=2), id="dp2xtp2"),
    pytest.param(dict(pp=2, dp_shard=2), id="pp2xdp2"),
]


@pytest.mark.parametrize("strategy", LAYOUTS)
def test_a_torch_compiled_module_trains_compiled_per_block_as_compile_true_does(pool4, strategy):
    reference = run_reference(max_steps=4)
    runs = {
        how: pool4.run(compiled_job, strategy=strategy, devices=4, how=how) for how in ("compile=True", "torch.compile")
    }
    for how, ranks in runs.items():
        assert_parity(ranks[0], reference)
        for rank in ranks:
            # each rank's own blocks (2 blocks, or 1 per pipeline stage), nothing else; the step methods uncompiled
            assert rank["compiled"] and all(".h." in f".{name}." for name in rank["compiled"]), (how, rank["compiled"])
            assert len(rank["compiled"]) == (1 if "pp" in strategy else 2), (how, rank["compiled"])
            assert rank["orig_mod_names"] == [] and not rank["step_methods_compiled"]
            graphs = rank["graphs"]
            assert graphs[0] > 0 and graphs[-1] == graphs[1], f"{how}: recompiled after the first steps: {graphs}"
    for a, b in zip(runs["compile=True"], runs["torch.compile"], strict=True):
        assert a["losses"] == b["losses"]


def test_inductor_on_cpu_trains_on_the_single_process_trajectory(pool2):
    """``compile=True`` with torch's defaults (inductor: C++ generated, compiled and run on CPU) at dp_shard=2."""
    from tests.compile_runs import run_compiled

    ranks = pool2.run(run_compiled, strategy=dict(dp_shard=2, compile=True), devices=2, max_steps=4)
    assert_parity(ranks[0], run_reference(max_steps=4))
    for rank in ranks:
        assert rank["graphs"][0] > 0 and rank["graphs"][-1] == rank["graphs"][1], rank["graphs"]


def test_3d_with_sequence_parallelism_traces_on_the_single_process_trajectory(pool8):
    """pp2 × dp_shard2 × tp2 on 8 ranks, sequence-parallel: each stage's block compiled with its DTensor hooks."""
    from tests.compile_runs import run_compiled

    strategy = dict(pp=2, dp_shard=2, tp=2, sequence_parallel=True, **TRACED)
    ranks = pool8.run(run_compiled, strategy=strategy, devices=8, max_steps=4)
    assert_parity(ranks[0], run_reference(max_steps=4))
    for rank in ranks:
        assert rank["graphs"][0] > 0 and rank["graphs"][-1] == rank["graphs"][1], rank["graphs"]


@pytest.mark.parametrize(
    ("strategy", "pool"),
    [
        pytest.param(dict(dp_shard=2, tp=2), 4, id="dp2xtp2"),
        pytest.param(dict(pp=2, dp_shard=2, tp=2), 8, id="3d"),
    ],
    indirect=["pool"],
)
def test_a_transformers_llama_compiles_per_layer(strategy, pool):
    """An unmodified transformers Llama with its own plan at dp_shard=2 × tp=2 and in 3D: each decoder layer
    compiled in place (its attention through transformers' own SDPA path; under pp, each stage's layers), one
    process's losses and parameters, no recompilation."""
    from tests.compile_runs import run_compiled
    from tests.hf_runs import run_reference as llama_reference

    strategy = dict(strategy, tp_plan="auto", **TRACED)
    ranks = pool.run(run_compiled, strategy=strategy, devices=pool.world_size, transformers=True, max_steps=4)
    assert_parity(ranks[0], llama_reference({}, max_steps=4))
    for rank in ranks:
        assert rank["graphs"][0] > 0 and rank["graphs"][-1] == rank["graphs"][1], rank["graphs"]


@functools.cache
def one_batch_reference() -> dict:
    return run_reference(max_steps=4, data=ONE_BATCH_EPOCHS)


def test_a_compiled_runs_checkpoint_resumes_eagerly_at_another_layout_and_back(pool4, tmp_path):
    """Parameter and checkpoint names are the same compiled or not: 2 steps compiled at dp_shard=2 × tp=2, 1 step
    eager at pp=2 × dp_shard=2 resumed from its checkpoint, then 1 step compiled at dp_shard=2 × tp=2 again, continue
    one process's run (traced with ``aot_eager``: the names do not depend on the generated code)."""
    from tests.compile_runs import run_compiled

    run = functools.partial(pool4.run, run_compiled, devices=4, data=ONE_BATCH_EPOCHS)
    compiled, eager = dict(dp_shard=2, tp=2, **TRACED), dict(pp=2, dp_shard=2)
    run(strategy=compiled, max_steps=2, ckpt_dir=str(tmp_path / "a"))
    third = run(
        strategy=eager, max_steps=3, resume_from=str(tmp_path / "a" / "last.ckpt"), ckpt_dir=str(tmp_path / "b")
    )
    fourth = run(strategy=compiled, max_steps=4, resume_from=str(tmp_path / "b" / "last.ckpt"))[0]
    whole = one_batch_reference()
    losses = third[0]["losses"] + fourth["losses"]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(whole["losses"][2:]), rtol=1e-4, atol=0)
    assert_parity({"losses": fourth["losses"], "params": fourth["params"]}, {**whole, "losses": whole["losses"][3:]})


def fabric_setup_of_a_compiled_model() -> str:
    """``fabric.setup(torch.compile(model))`` then a training step: what par3d says."""
    import lightning as L

    from examples.fabric_train import gpt_loss
    from examples.gpt import GPT, GPT_TP_PLAN, GPTConfig
    from lightning_par3d import Par3DFabricStrategy
    from tests.fabric_runs import FABRIC_MODEL

    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=Par3DFabricStrategy(pp=2, tp_plan=GPT_TP_PLAN))
    fabric.launch()
    with fabric.init_module():
        model = GPT(GPTConfig(**FABRIC_MODEL))
    model = fabric.setup(torch.compile(model, backend="eager"))
    x = torch.randint(0, 256, (4, 32))
    try:
        fabric.strategy.train_step(model, x, x, gpt_loss)
    except ValueError as error:
        return str(error)
    return "trained"


def test_fabric_setup_of_a_whole_compiled_model_is_refused_with_the_fix(pool2):
    """Fabric compiles the whole module after par3d's setup, around the pipeline schedule, whose stages would run
    uncompiled: refused, naming ``compile=True``, which compiles each block in place."""
    for said in pool2.run(fabric_setup_of_a_compiled_model):
        assert said.startswith("fabric.setup(torch.compile(model)) compiles the whole module after par3d"), said
        assert "Par3DFabricStrategy(..., compile=True)" in said
