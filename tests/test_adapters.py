"""PEFT LoRA adapters on an unmodified transformers Llama (``get_peft_model`` in the module, nothing else changed):
the plan par3d derives for the adapters, and parity with one process (fp32, rtol 1e-4) on the losses and every
parameter, the frozen base bit-identical to where it started, with gradient clipping on."""

from __future__ import annotations

import functools
import re

import pytest
import torch

from lightning_par3d.parallel.adapters import adapter_plan
from lightning_par3d.parallel.tensor_parallel import expand_plan, transformers_plan
from tests import hf_runs
from tests.conftest import assert_parity

peft = pytest.importorskip("peft", reason="the hf extra installs peft")

LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"], lora_dropout=0.0)
CLIP = dict(gradient_clip_val=0.5)


def lora_module() -> object:
    module = hf_runs.module({"lora": LORA})
    with torch.device("meta"):
        module.configure_model()
    return module


def test_the_models_own_plan_splits_each_adapter_like_its_base_layer():
    module = lora_module()
    plan = adapter_plan(module, expand_plan(module, transformers_plan(module)))
    layer = "model.base_model.model.model.layers.1"
    assert plan[f"{layer}.self_attn.q_proj.base_layer"] == "colwise"
    assert plan[f"{layer}.self_attn.q_proj.lora_B.default"] == "colwise"  # output columns, as the base's
    assert f"{layer}.self_attn.q_proj.lora_A.default" not in plan  # whole: its input is
    assert plan[f"{layer}.self_attn.o_proj.base_layer"] == "rowwise"
    assert plan[f"{layer}.self_attn.o_proj.lora_A.default"] == "rowwise"  # input columns, r outputs summed
    assert f"{layer}.self_attn.o_proj.lora_B.default" not in plan
    assert plan[f"{layer}.self_attn.k_proj"] == "colwise"  # not adapted: as it was
    assert f"{layer}.self_attn.q_proj" not in plan


def test_an_adapter_par3d_cannot_split_is_refused_by_name():
    module = lora_module()
    with pytest.raises(ValueError, match=re.escape("q_proj: LoRA adapters under 'all_reduce'")):
        adapter_plan(module, {"model.base_model.model.model.layers.0.self_attn.q_proj": "all_reduce"})


def test_what_par3d_does_not_do_with_adapters_yet_is_refused_with_the_fix():
    from lightning_par3d import Par3DConfig
    from lightning_par3d.memory.estimate import estimate_memory
    from lightning_par3d.pipeline.hf import check_pipelinable

    with pytest.raises(ValueError, match=r"PeftModel is a peft model: par3d does not pipeline adapter models yet"):
        check_pipelinable(lora_module().model)
    with pytest.raises(ValueError, match=r"memory estimator .* cannot build a peft adapter model yet"):
        estimate_memory(hf_runs.module({"lora": LORA}), Par3DConfig(dp_shard=2), 2, (4, 32))


@functools.cache
def reference() -> dict:
    return hf_runs.run_reference({"lora": LORA}, **CLIP)


@pytest.mark.parametrize(
    "strategy",
    [
        pytest.param(dict(dp_shard=2, tp=2, tp_plan="auto"), id="dp2xtp2"),
        pytest.param(dict(dp_shard=4), id="dp_shard=4"),
    ],
)
def test_lora_trains_as_one_process_and_leaves_the_base_as_it_was(pool4, strategy):
    ref = reference()
    got = pool4.run(hf_runs.run_par3d, strategy=strategy, devices=4, model={"lora": LORA}, **CLIP)[0]
    assert_parity(got, ref)
    initial = hf_runs.initial_state({"lora": LORA})
    for name, value in got["params"].items():
        if "lora_" not in name:  # the frozen base: exactly the weights it started from, at every layout
            assert torch.equal(value, initial[name]), name
        else:
            assert not torch.equal(value, initial[name]), f"{name} did not train"
