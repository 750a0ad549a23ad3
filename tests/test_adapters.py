"""PEFT LoRA adapters on an unmodified transformers Llama (``get_peft_model`` in the module, nothing else changed):
the plan par3d derives for the adapters, and parity with one process (fp32, rtol 1e-4) on the losses and every
parameter, the frozen base bit-identical to where it started, with gradient clipping on."""

from __future__ import annotations

import functools
import re
from pathlib import Path

import pytest
import torch

from lightning_par3d.parallel.lora_plan import adapter_plan
from lightning_par3d.parallel.tensor_parallel import expand_plan, transformers_plan
from tests import hf_runs
from tests.conftest import assert_parity
from tests.constants import BF16_MIXED_RTOL, BF16_TRUE_RTOL

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


def lora_memory_job(strategy: dict, devices: int) -> dict:
    import torch.distributed as dist

    from tests.test_estimate import MemoryProbe

    probe = MemoryProbe()
    hf_runs.run_par3d(strategy, devices, model={"lora": LORA}, max_steps=3, extra_callbacks=[probe])
    return {"state": probe.state, "activations": probe.activations, "rank": dist.get_rank()}


def test_the_estimate_of_a_lora_model_is_what_its_ranks_hold(pool4):
    """A frozen base holds its parameters only: no gradients, no optimizer state. The estimator counts it so (the
    measured model state within 5 %, the total within 10 %), and a LoRA fine-tune needs far less than a full one."""
    from lightning_par3d import Par3DConfig
    from lightning_par3d.distributed.mesh import Par3DMesh
    from lightning_par3d.memory.estimate import estimate_memory
    from tests.gpt_runs import GLOBAL_BATCH

    strategy = dict(pp=2, tp=2, tp_plan="auto", microbatches=2)
    measured = pool4.run(lora_memory_job, strategy=strategy, devices=4)
    config = Par3DConfig(**strategy)
    batch = (GLOBAL_BATCH // 1, hf_runs.TINY["block_size"])
    estimate = estimate_memory(hf_runs.module({"lora": LORA}), config, 4, batch)
    full = estimate_memory(hf_runs.module(), config, 4, batch)
    mesh = Par3DMesh(estimate.layout)
    for got in measured:
        pp_rank = mesh.coords(got["rank"]).pp
        row = estimate.rows[pp_rank]
        for kind in ("params", "grads", "optimizer"):
            want, have = getattr(row.state, kind), getattr(got["state"], kind)
            assert abs(want - have) <= 0.05 * have, f"rank {got['rank']} {kind}: estimated {want}, measured {have}"
        want, have = row.state.total + row.activations, got["state"].total + got["activations"]
        assert abs(want - have) <= 0.1 * have, f"rank {got['rank']}: estimated {want}, measured {have}"
        assert row.state.grads < 0.2 * full.rows[pp_rank].state.grads


@functools.cache
def reference(architecture: str = "llama") -> dict:
    return hf_runs.run_reference({"lora": LORA, "architecture": architecture}, **CLIP)


@pytest.mark.parametrize(
    "strategy",
    [
        pytest.param(dict(dp_shard=2, tp=2, tp_plan="auto"), id="dp2xtp2"),
        pytest.param(dict(dp_shard=2, dp_replicate=2), id="hsdp-dp_shard2xdp_replicate2"),
        pytest.param(dict(pp=2, dp_shard=2, microbatches=2, activation_checkpointing="full"), id="pp2xdp2-full-ac"),
        pytest.param(dict(cp=2, dp_shard=2), id="cp2xdp2"),
    ],
)
def test_lora_trains_as_one_process_and_leaves_the_base_as_it_was(pool4, strategy):
    ref = reference()
    got = pool4.run(hf_runs.run_par3d, strategy=strategy, devices=4, model={"lora": LORA}, **CLIP)[0]
    assert_parity(got, ref)
    assert_only_the_adapters_moved(got["params"], {"lora": LORA})


def assert_only_the_adapters_moved(params: dict, model: dict) -> None:
    """The frozen base holds exactly the weights it started from; every adapter trained."""
    initial = hf_runs.initial_state(model)
    for name, value in params.items():
        if "lora_" not in name:
            assert torch.equal(value, initial[name]), name
        else:
            assert not torch.equal(value, initial[name]), f"{name} did not train"


@pytest.mark.parametrize(
    ("strategy", "precision", "rtol"),
    [
        pytest.param(
            dict(dp_shard=2, tp=2, tp_plan="auto", activation_checkpointing="full"),
            "bf16-mixed",
            BF16_MIXED_RTOL,
            id="dp2xtp2-full-ac-bf16-mixed",
        ),
        pytest.param(dict(dp_shard=4), "bf16-true", BF16_TRUE_RTOL, id="zero3-bf16-true"),
    ],
)
def test_lora_in_mixed_precision_stays_close_to_fp32(pool4, strategy, precision, rtol):
    """bf16-mixed: fp32 weights, bf16 matmuls; bf16-true: a bf16 base with fp32 adapters (peft keeps adapters in
    fp32 over a bf16 base), one FSDP2 unit holding both. Both train within bf16's tolerance of fp32 (see
    tests/constants.py), with clipping over the frozen and trained, sharded and replicated parameters."""
    got = pool4.run(hf_runs.run_par3d, strategy=strategy, devices=4, model={"lora": LORA}, precision=precision, **CLIP)[
        0
    ]
    want = reference()["losses"]
    relative = [abs(a - b) / abs(b) for a, b in zip(got["losses"], want, strict=True)]
    assert 0 < max(relative) <= rtol, relative
    adapters = {str(v.dtype) for k, v in got["params"].items() if "lora_" in k}
    base = {str(v.dtype) for k, v in got["params"].items() if "lora_" not in k}
    assert adapters == {"torch.float32"}
    assert base == ({"torch.bfloat16"} if precision == "bf16-true" else {"torch.float32"})


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
def test_lora_trains_as_one_process_in_3d(pool8, architecture):
    """pp=2 × dp_shard=2 × tp=2 with the model's own plan: the adapters travel with their blocks and split with
    their base layers (Qwen2: over base layers with biases)."""
    got = pool8.run(
        hf_runs.run_par3d,
        strategy=dict(pp=2, dp_shard=2, tp=2, tp_plan="auto", microbatches=2),
        devices=8,
        model={"lora": LORA, "architecture": architecture},
        **CLIP,
    )[0]
    assert_parity(got, reference(architecture))
    assert_only_the_adapters_moved(got["params"], {"lora": LORA, "architecture": architecture})


def test_a_lora_fine_tune_fits_where_the_full_one_does_not_and_the_plan_says_so():
    """One device of 1.2 MiB: the full fine-tune's smallest layout (full checkpointing) needs 1.48 MiB, the LoRA
    one's less than 1 MiB (no gradients or Adam state for the base)."""
    from lightning_par3d.planning import plan

    with pytest.raises(ValueError, match="No layout of CausalLMModule on 1 ranks fits"):
        plan(hf_runs.module(), 1, device_memory="1.2MiB", global_batch=8, seq_len=32)
    table = plan(hf_runs.module({"lora": LORA}), 1, device_memory="1.2MiB", global_batch=8, seq_len=32)
    assert table.fitting and all(row.peak_memory < 1.2 * 2**20 for row in table.fitting)


def peft_saved_adapters(base_dir: Path, directory: Path) -> Path:
    """Adapters of ``LORA`` on the pretrained base, written by peft itself, with ``lora_B`` drawn away from zero so
    that they change the model."""
    from transformers import AutoModelForCausalLM

    adapted = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(base_dir), peft.LoraConfig(**LORA))
    generator = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, param in adapted.named_parameters():
            if "lora_B" in name:
                param.copy_(0.1 * torch.randn(param.shape, generator=generator))
    adapted.save_pretrained(directory)
    return directory


def test_adapters_in_and_out_as_peft_has_them(pool4, tmp_path):
    """A pretrained base and adapters peft saved are read at pp2×tp2, each rank only its slices; 3 steps match one
    process that loads them with ``from_pretrained`` (``is_trainable=True``); ``SavePretrained`` writes the trained
    adapters as peft does, and ``PeftModel.from_pretrained`` on the base gives every rank's logits."""
    from transformers import AutoModelForCausalLM

    base = hf_runs.save_tiny_pretrained(tmp_path / "base")
    adapters = peft_saved_adapters(base, tmp_path / "adapters")
    model = {"pretrained_path": str(base), "adapter_path": str(adapters)}
    strategy = dict(pp=2, tp=2, tp_plan="auto", init="pretrained", adapter_path=str(adapters))
    ids = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(7))
    export = tmp_path / "exported"
    ranks = pool4.run(
        hf_runs.run_par3d, strategy=strategy, devices=4, model=model, max_steps=3, export_to=str(export), logits_of=ids
    )
    assert_parity(ranks[0], hf_runs.run_reference(model, max_steps=3))
    total = sum(p.numel() * p.element_size() for p in AutoModelForCausalLM.from_pretrained(base).parameters())
    for rank in ranks:
        assert rank["real_bytes_built"] == 0, "a rank built real parameters"
        assert 0 < rank["bytes_read"] < 0.6 * total, (rank["bytes_read"], total)

    assert sorted(p.name for p in export.iterdir()) == ["README.md", "adapter_config.json", "adapter_model.safetensors"]
    reloaded = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), export)
    trained = ranks[0]["params"]
    for name, value in reloaded.state_dict().items():
        assert torch.equal(value, trained[f"model.{name}"]), name
    with torch.no_grad():
        logits = reloaded(ids).logits
    for rank in ranks:
        torch.testing.assert_close(rank["logits"], logits, rtol=1e-5, atol=1e-5 * logits.abs().max().item())


def test_fresh_adapters_on_a_pretrained_base_start_as_the_base_at_every_layout(pool4, tmp_path):
    """init='pretrained' without saved adapters: every rank gets its slices of the same adapters, drawn from the
    seed and each adapter's name (lora_A as nn.Linear, lora_B zero), as one process draws them."""
    import lightning as L

    from lightning_par3d.checkpoint.peft_files import adapter_keys, init_fresh_adapters
    from tests.gpt_runs import SEED

    base = hf_runs.save_tiny_pretrained(tmp_path / "base")
    model = {"pretrained_path": str(base), "lora": LORA}
    strategy = dict(dp_shard=2, tp=2, tp_plan="auto", init="pretrained")
    got = pool4.run(hf_runs.run_par3d, strategy=strategy, devices=4, model=model, max_steps=0)[0]["params"]
    L.seed_everything(SEED, verbose=False)
    one = hf_runs.module(model)
    one.configure_model()
    init_fresh_adapters(one)
    want = one.state_dict()
    assert sorted(got) == sorted(want)
    for name in adapter_keys(one):
        assert torch.equal(got[name], want[name]), name
        assert ("lora_B" in name) == (not want[name].any()), name


@pytest.mark.parametrize("front_end", ["fabric", "accelerate"])
def test_lora_under_fabric_and_accelerate_trains_as_one_process(pool4, front_end):
    """The same loop (a transformers model with peft's adapters, an optimizer over the adapters) under Fabric and
    Accelerate at pp2×tp2, against the loop in one plain process."""
    loop = hf_runs.fabric_hf_loop if front_end == "fabric" else hf_runs.accelerate_hf_loop
    got = pool4.run(loop, strategy=dict(pp=2, tp=2), lora=LORA)[0]
    assert_parity(got, hf_runs.accelerate_hf_loop(None, lora=LORA))


def test_the_dry_run_of_a_lora_model_in_3d_holds_gradients_of_the_adapters_only(new_interpreter):
    """The last rank of pp2×dp2×tp2 (last stage, tp rank 1), in a process of its own: the whole step runs, and the
    rank holds gradients and optimizer state for the adapters only, the bytes the estimator counts."""
    from lightning_par3d import Par3DConfig
    from lightning_par3d.memory.estimate import estimate_memory
    from lightning_par3d.tools.dry_run import dry_run

    ids = torch.zeros(4, 32, dtype=torch.long)
    config = Par3DConfig(pp=2, dp_shard=2, tp=2, tp_plan="auto")
    result = dry_run(hf_runs.module({"lora": LORA}), config, 8, (ids, ids), ranks=[7])
    estimate = estimate_memory(hf_runs.module({"lora": LORA}), config, 8, (4, 32))
    for rank in result.ranks:
        state = estimate.rows[rank.coordinates["pp"]].state
        assert (rank.params, rank.grads, rank.optimizer) == (state.params, state.grads, state.optimizer), rank
        assert 0 < rank.grads < 0.2 * rank.params, rank
