"""Mixture-of-experts transformers models, unchanged, with their own tensor-parallel plans: the experts' 3-D weights
split over tp by the plan's entries naming them (``experts.gate_up_proj``: ``packed_colwise``, ``experts.down_proj``:
``rowwise``) under ``moe_tp_experts``; the model's own plan applied where its config lacks some of the modules it
names (the dense MLP entries of an all-sparse config), a user's own plan checked strictly. Parity with one process on
the samples each rank read (``tests/hf_runs.py``)."""

from __future__ import annotations

import functools

import pytest

from tests import padded_runs
from tests.conftest import assert_parity
from tests.hf_runs import module, run_par3d, run_reference

MOE = {
    # top-2 of 4 experts, each of hidden 16, in every layer; the router's probabilities renormalised over the top-k
    "qwen3_moe": dict(
        architecture="qwen3_moe",
        config_overrides=dict(
            head_dim=8,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            decoder_sparse_step=1,
            norm_topk_prob=True,
        ),
    ),
    "mixtral": dict(architecture="mixtral", config_overrides=dict(num_local_experts=4, num_experts_per_tok=2)),
    # a shared expert beside the routed ones, with its own sigmoid gate (the plan leaves it whole on every rank)
    "qwen2_moe": dict(
        architecture="qwen2_moe",
        config_overrides=dict(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=32,
            decoder_sparse_step=1,
        ),
    ),
}
EXPERT_WEIGHTS = {"gate_up_proj", "down_proj"}


@functools.cache
def reference(name: str) -> dict:
    return run_reference(MOE[name])


def _experts_split(got: dict) -> set[str]:
    return {name.rsplit(".", 1)[1] for name in got["split_over_tp"] if ".experts." in name}


@pytest.mark.parametrize("name", list(MOE))
def test_the_models_own_plan_at_dp_shard2_x_tp2(pool4, name):
    got = pool4.run(run_par3d, strategy=dict(dp_shard=2, tp=2, tp_plan="auto"), devices=4, model=MOE[name])[0]
    assert _experts_split(got) == EXPERT_WEIGHTS  # every expert cut along its hidden size, not left whole
    assert_parity(got, reference(name))


def test_with_full_activation_checkpointing(pool4):
    """Each decoder layer recomputed in backward, its experts' collectives too."""
    strategy = dict(dp_shard=2, tp=2, tp_plan="auto", activation_checkpointing="full")
    got = pool4.run(run_par3d, strategy=strategy, devices=4, model=MOE["qwen3_moe"])[0]
    assert_parity(got, reference("qwen3_moe"))


def test_pipelined_with_the_models_own_plan_at_pp2_x_tp2(pool4):
    """Each stage applies the plan's entries for the experts it holds, and takes its interleaved shards of rank 0's
    initial weights (the last stage's ranks do not include rank 0)."""
    got = pool4.run(run_par3d, strategy=dict(pp=2, tp=2, tp_plan="auto"), devices=4, model=MOE["qwen3_moe"])[0]
    assert _experts_split(got) == EXPERT_WEIGHTS
    assert_parity(got, reference("qwen3_moe"))


def _built(name: str):
    return _built_from(MOE[name])


def _built_from(model: dict):
    lm = module(model)
    lm.configure_model()
    return lm


def test_the_models_own_plan_skips_what_this_config_lacks_and_a_users_own_plan_does_not(caplog):
    """The Qwen3-MoE plan names dense MLP modules (``mlp.gate_proj`` …), which an all-sparse config does not have:
    skipped (at debug level) in the model's own plan; the same entries in a user's dict are refused, naming them."""
    import logging

    from lightning_par3d.parallel.tensor_parallel import expand_plan, transformers_plan

    lm = _built("qwen3_moe")
    own = transformers_plan(lm)
    with caplog.at_level(logging.DEBUG, logger="lightning_par3d.parallel.tensor_parallel"):
        expanded = expand_plan(lm, own)
    assert expanded["model.model.layers.1.mlp.experts"] == "moe_tp_experts"
    assert expanded["model.model.layers.1.mlp.experts.gate_up_proj"] == "packed_colwise"
    assert expanded["model.model.layers.0.mlp.experts.down_proj"] == "rowwise"
    assert not any(".mlp.gate_proj" in name for name in expanded)
    assert "model.model.layers.*.mlp.gate_proj" in caplog.text
    with pytest.raises(ValueError, match=r"'model.model.layers.\*.mlp.gate_proj' matches no module"):
        expand_plan(lm, dict(own))


def test_parameter_entries_need_a_splitting_style_and_a_module_that_runs_on_local_shards():
    from lightning_par3d.parallel.tensor_parallel import expand_plan

    lm = _built("qwen3_moe")
    experts = "model.layers.*.mlp.experts"
    with pytest.raises(ValueError, match=r"its module 'model.model.layers.0.mlp.experts' has no entry: give it a"):
        expand_plan(lm, {f"{experts}.gate_up_proj": "packed_colwise"})
    with pytest.raises(ValueError, match=r"'model.model.layers.0.mlp.experts' has 'colwise': give it a style that"):
        expand_plan(lm, {f"{experts}.gate_up_proj": "packed_colwise", experts: "colwise"})
    with pytest.raises(ValueError, match=r"an entry naming a parameter splits it with one of .*, not 'sequence_par"):
        expand_plan(lm, {f"{experts}.gate_up_proj": "sequence_parallel", experts: "moe_tp_experts"})


def test_tp_that_does_not_divide_an_experts_hidden_size_is_refused_naming_it():
    from lightning_par3d import Par3DConfig
    from lightning_par3d.compose import checked_plan

    lm = _built("qwen3_moe")  # moe_intermediate_size 16: the packed gate_up_proj splits 16 per component
    with pytest.raises(ValueError, match=r"tp=3 does not divide model.model.layers.0.mlp.experts.gate_up_proj "
                                         r"dimension -2 \(16\) that style 'packed_colwise' splits"):  # fmt: skip
        checked_plan(lm, Par3DConfig(tp=3, tp_plan="auto"), 3)


# ---------------------------------------------------------------- expert parallelism


@pytest.mark.parametrize(
    "name, strategy",
    [
        ("qwen3_moe", dict(dp_shard=4, ep=4)),  # one expert a rank, one rank holding each
        ("mixtral", dict(dp_shard=4, ep=2)),  # two experts a rank, FSDP2 over the two ranks holding them
        ("qwen2_moe", dict(pp=2, dp_shard=2, ep=2)),  # a shared expert beside them; each stage's experts
        # HSDP: the experts sharded over nothing, replicated over dp_replicate; every layer recomputed in backward,
        # its all-to-alls too
        ("qwen3_moe", dict(dp_replicate=2, dp_shard=2, ep=2, activation_checkpointing="full")),
        ("qwen3_moe", dict(dp_shard=4, ep=2, compile=True)),  # the routing runs eager between compiled parts
        # ep over the dp_shard ranks, each expert also cut over tp by the model's own plan (moe_tp_experts)
        ("qwen3_moe", dict(dp_shard=2, tp=2, ep=2, tp_plan="auto")),
        # the experts split over the ranks of dp_shard × cp: each row's tokens cut over cp, routed to their experts
        # (dp_shard2 × cp2 × ep2: the router's loss tests below)
        ("qwen3_moe", dict(dp_shard=2, cp=2, ep=4)),
    ],
    ids=[
        "qwen3_moe-dp_shard4xep4",
        "mixtral-dp_shard4xep2",
        "qwen2_moe-pp2xdp_shard2xep2",
        "qwen3_moe-hsdp2x2xep2-full_ac",
        "qwen3_moe-dp_shard4xep2-compiled",
        "qwen3_moe-dp_shard2xtp2xep2",
        "qwen3_moe-dp_shard2xcp2xep4",
    ],
)
def test_expert_parallel(pool4, name, strategy):
    """Each rank holds num_experts / ep whole experts; every token's choices run where their experts are (all-to-all
    there and back) and the router's weights sum them as the model does; each expert's gradient is the mean over
    the whole dp, reduced over exactly the ranks that hold it. The single-process trajectory, on the samples each
    rank read."""
    got = pool4.run(run_par3d, strategy=strategy, devices=4, model=MOE[name])[0]
    held = got["split_over_ep"]
    assert {n.rsplit(".", 1)[1] for n in held} == EXPERT_WEIGHTS and set(held.values()) == {strategy["ep"]}, held
    assert _experts_split(got) == (EXPERT_WEIGHTS if "tp" in strategy else set())
    assert_parity(got, reference(name))


@pytest.mark.parametrize(
    "name, strategy",
    [
        ("qwen3_moe", dict(dp_shard=2, tp=2)),
        ("qwen3_moe", dict(dp_shard=2, tp=2, ep=2)),
        ("qwen2_moe", dict(dp_shard=2, tp=2)),  # the shared expert's plan entries kept inside the whole region
        ("mixtral", dict(pp=2, tp=2)),  # the stages exchange sequence shards
    ],
    ids=["qwen3_moe-dp_shard2xtp2", "qwen3_moe-dp_shard2xtp2xep2", "qwen2_moe-dp_shard2xtp2", "mixtral-pp2xtp2"],
)
def test_sequence_parallel_runs_each_moe_block_on_the_whole_sequence(pool4, name, strategy):
    """``sequence_parallel=True`` with the model's own plan: the residual stream split along the sequence over tp,
    each mixture-of-experts block gathering it on entry (``whole_sequence``) so that every tp rank routes the same
    tokens to its part of each expert (or, with ep, to the ranks holding them), and cutting its summed output back
    to the rank's shard. The single-process trajectory."""
    strategy = dict(strategy, tp_plan="auto", sequence_parallel=True)
    got = pool4.run(run_par3d, strategy=strategy, devices=4, model=MOE[name])[0]
    assert _experts_split(got) == EXPERT_WEIGHTS
    assert_parity(got, reference(name))


def test_the_sequence_parallel_plan_of_a_moe_model_keeps_its_blocks_plan_inside_the_whole_region():
    from lightning_par3d.parallel.sequence_parallel import sequence_parallel_plan
    from lightning_par3d.parallel.tensor_parallel import expand_plan, transformers_plan

    lm = _built("qwen2_moe")
    plain = expand_plan(lm, transformers_plan(lm))
    plan = sequence_parallel_plan(lm, plain)
    layer = "model.model.layers.1"
    assert plan[f"{layer}.mlp"] == "whole_sequence" and plan[f"{layer}.self_attn"] == "gather_sequence"
    assert plan[f"{layer}.self_attn.o_proj"] == "rowwise_seq"
    assert plan[f"{layer}.post_attention_layernorm"] == "sequence_parallel"
    inside = {name: style for name, style in plan.items() if name.startswith(f"{layer}.mlp.")}
    assert inside == {name: plain[name] for name in inside} and inside[f"{layer}.mlp.experts"] == "moe_tp_experts"


def test_an_expert_parallel_checkpoint_resumes_at_another_ep_and_exports_whole_experts(pool4, tmp_path):
    """Saved at dp_shard=4 × ep=4 (one expert a rank), resumed at pp=2 × dp_shard=2 × ep=2 and back, and between
    dp_shard=2 × tp=2 × ep=2 and ep=4, on the single-process trajectory; ``SavePretrained`` of a dp_shard=4 × ep=2
    run writes every expert, which ``AutoModelForCausalLM.from_pretrained`` loads as the trained weights (its logits
    one process's trained model's), and so does ``par3d export-hf`` of its checkpoint."""
    import torch
    from transformers import AutoModelForCausalLM

    from lightning_par3d.tools.export_hf import main as convert
    from tests.hf_runs import assert_resumes_both_ways

    model = MOE["qwen3_moe"]
    assert_resumes_both_ways(pool4, model, dict(dp_shard=4, ep=4), dict(pp=2, dp_shard=2, ep=2), tmp_path)
    cut = dict(dp_shard=2, tp=2, ep=2, tp_plan="auto")  # each expert also cut over tp, interleaved gate and up
    assert_resumes_both_ways(pool4, model, cut, dict(dp_shard=4, ep=4), tmp_path / "cut")
    export, checkpoint = tmp_path / "exported", tmp_path / "trained.ckpt"
    run = dict(devices=4, model=model, export_to=str(export), checkpoint_to=str(checkpoint))
    trained = pool4.run(run_par3d, strategy=dict(dp_shard=4, ep=2), **run)[0]
    reloaded = AutoModelForCausalLM.from_pretrained(export)
    for name, value in reloaded.state_dict().items():
        assert torch.equal(value, trained["params"][f"model.{name}"]), name
    one_process = reference("qwen3_moe")
    assert_parity(trained, one_process)
    alone = AutoModelForCausalLM.from_config(reloaded.config)  # the single-process run's trained weights
    alone.load_state_dict({name.removeprefix("model."): value for name, value in one_process["params"].items()})
    ids = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        want, got = alone.eval()(ids).logits, reloaded.eval()(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())  # one process's logits
    converted = tmp_path / "converted"  # par3d export-hf of the run's checkpoint: the same experts
    assert convert([str(checkpoint), str(converted), "--config", str(export)]) == 0
    again = AutoModelForCausalLM.from_pretrained(converted).state_dict()
    assert all(torch.equal(again[name], value) for name, value in reloaded.state_dict().items())


def test_expert_parallel_clips_the_whole_models_gradient_norm(pool4):
    """The experts' gradients live on the experts' own mesh (FSDP2 over the ranks sharing them × ep × tp): their
    norm joins the dense weights' in the one global norm that clipping scales by (0.05: every step clipped)."""
    strategy = dict(dp_shard=2, tp=2, ep=2, tp_plan="auto")
    got = pool4.run(run_par3d, strategy=strategy, devices=4, model=MOE["qwen3_moe"], gradient_clip_val=0.05)[0]
    assert_parity(got, run_reference(MOE["qwen3_moe"], gradient_clip_val=0.05))


def test_expert_parallel_with_lora_on_the_attention_and_in_bf16_mixed(pool4):
    """peft LoRA adapters on the attention of a model whose experts are split over ep: one process's trajectory;
    bf16-mixed at ep=2 within bf16's tolerance of the fp32 run."""
    from tests.constants import BF16_MIXED_RTOL

    adapted = {**MOE["qwen3_moe"], "lora": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])}
    strategy = dict(dp_shard=4, ep=2)
    got = pool4.run(run_par3d, strategy=strategy, devices=4, model=adapted)[0]
    assert_parity(got, run_reference(adapted))
    got = pool4.run(run_par3d, strategy=strategy, devices=4, model=MOE["qwen3_moe"], precision="bf16-mixed")[0]
    fp32 = reference("qwen3_moe")["losses"]
    assert max(abs(a - b) / b for a, b in zip(got["losses"], fp32, strict=True)) <= BF16_MIXED_RTOL


def test_expert_parallel_refusals():
    """Before any process group: ep not dividing dp_shard, ep beside ZeRO-1/2 or layout='auto'. At the model, on
    every rank before any data moves: a model without experts, an ep that does not divide the experts, and experts
    carrying LoRA adapters (peft's ``target_parameters``)."""
    from lightning_par3d import Par3DConfig
    from lightning_par3d.config import resolve_layout
    from lightning_par3d.parallel.expert_parallel import find_experts

    for config, message in (
        (Par3DConfig(dp_shard=4, ep=3), r"ep=3 splits the experts over ranks taken from dp_shard, but dp_shard=4"),
        (Par3DConfig(dp_shard=4, ep=2, zero_stage=1), r"ep=2 runs under FSDP2 \(zero_stage=3\).*zero_stage=1"),
        (Par3DConfig(ep=0), r"ep=0 must be a positive integer"),
    ):
        with pytest.raises(ValueError, match=message):
            resolve_layout(config, 4)
    with pytest.raises(ValueError, match=r"ep=2 splits a mixture-of-experts model's experts .* but CausalLMModule "
                                         r"has no experts"):  # fmt: skip
        find_experts(module(), 2)
    with pytest.raises(ValueError, match=r"ep=3 does not divide the 4 experts of each layer .* Use an ep among "
                                         r"\[2, 4\]"):  # fmt: skip
        find_experts(_built("qwen3_moe"), 3)
    lora = dict(r=4, lora_alpha=8, target_modules=["q_proj"], target_parameters=["experts.gate_up_proj"])
    with pytest.raises(ValueError, match=r"ep=2 cannot split experts that carry LoRA adapters \(model.base_model"):
        find_experts(_built_from({**MOE["qwen3_moe"], "lora": lora}), 2)
    spec = find_experts(_built("qwen3_moe"), 2)
    assert spec.num_experts == 4 and spec.names == tuple(f"model.model.layers.{i}.mlp.experts" for i in (0, 1))


# ---------------------------------------------------------------- the router's load-balancing loss

ROUTER_LOSS = {
    "architecture": "qwen3_moe",
    "config_overrides": {**MOE["qwen3_moe"]["config_overrides"], "output_router_logits": True,
                         "router_aux_loss_coef": 0.1},
}  # fmt: skip
"""Qwen3-MoE adding its router's load-balancing loss (coefficient 0.1) to its own ``labels=`` loss."""


@functools.cache
def router_loss_reference() -> dict:
    return padded_runs.run_reference("right", padded_runs.OwnLossLM, model=ROUTER_LOSS)


@pytest.mark.parametrize(
    "pool, strategy",
    [
        (2, dict(dp_shard=2)),
        (4, dict(dp_shard=2, tp=2, tp_plan="auto")),
        (4, dict(dp_shard=4, ep=2)),
    ],
    indirect=["pool"],
    ids=["dp_shard2", "dp_shard2xtp2", "dp_shard4xep2"],
)
def test_the_router_loss_is_the_global_batchs(pool, strategy):
    """The load-balancing loss is a product of two means over the global batch (padded rows masked out): each
    data-parallel rank's routing counts are summed before its term is taken, so the run keeps the single-process
    trajectory. Computed on each rank's own rows (par3d before), it was 1.5e-3 off at the first step."""
    run = dict(strategy=strategy, devices=pool.world_size, side="right", module=padded_runs.OwnLossLM)
    got = pool.run(padded_runs.run_par3d, model=ROUTER_LOSS, **run)[0]
    assert_parity(got, router_loss_reference())


@pytest.mark.parametrize(
    "pool, strategy",
    [(2, dict(dp_shard=2)), (4, dict(dp_shard=4, ep=2)), (4, dict(dp_shard=2, cp=2, ep=2))],
    indirect=["pool"],
    ids=["dp_shard2", "dp_shard4xep2", "dp_shard2xcp2xep2"],
)
def test_the_router_loss_over_accumulated_batches_is_the_whole_windows(pool, strategy):
    """With 2 batches per step the counts run over the window: its second batch is routed ahead at the first (one
    forward without gradients), and checked as it trains. One process's trajectory on the whole global batch. Under
    cp (padded rows cut over the ranks) each slice counts with its columns of the caller's mask, and the later batch
    is made from the call as given and cut as the model's hook cuts it."""
    run = dict(strategy=strategy, devices=pool.world_size, side="right", module=padded_runs.OwnLossLM)
    got = pool.run(padded_runs.run_par3d, model=ROUTER_LOSS, accumulate=2, **run)[0]
    assert_parity(got, accumulated_router_loss_reference())


@pytest.mark.parametrize(
    "pool, strategy, accumulate",
    [
        (2, dict(pp=2), 1),
        (4, dict(pp=2, dp_shard=2, ep=2), 1),
        (4, dict(pp=2, dp_shard=2, microbatches=2), 2),
        (2, dict(pp=2, activation_checkpointing="full"), 1),
        (2, dict(pp=2, compile=True), 1),
        (4, dict(pp=2, cp=2, microbatches=2), 2),
    ],
    indirect=["pool"],
    ids=[
        "pp2",
        "pp2xdp_shard2xep2",
        "pp2xdp_shard2-accumulate2",
        "pp2-checkpointed",
        "pp2-compiled",
        "pp2xcp2-accumulate2",
    ],
)
def test_the_router_loss_under_pipelining_is_one_processs(pool, strategy, accumulate):
    """Under pp the model's forward, which adds its router's loss, never runs: its own ``labels=`` loss is run by
    par3d, which routes each window's batches ahead through the pipeline (forward only) for the counts, gives each
    router call its gradient term and adds the loss's value once. One process's trajectory, padded rows masked."""
    run = dict(strategy=strategy, devices=pool.world_size, side="right", module=padded_runs.OwnLossLM)
    got = pool.run(padded_runs.run_par3d, model=ROUTER_LOSS, accumulate=accumulate, **run)[0]
    reference = router_loss_reference() if accumulate == 1 else accumulated_router_loss_reference()
    assert_parity(got, reference)


@pytest.mark.parametrize(
    "pool, strategy",
    [(2, dict(pp=2)), (4, dict(pp=2, cp=2, microbatches=2))],
    indirect=["pool"],
    ids=["pp2", "pp2xcp2"],
)
def test_the_router_loss_under_pipelining_in_validation_is_one_processs(pool, strategy):
    """Forward only (validation), the pipelined model's own loss adds its router's loss over the batch, summed over
    the pipeline stages (and the cp ranks' slices of the rows): the loss and ``aux_loss`` one process's model
    returns."""
    got = pool.run(padded_runs.validate_own_loss, model=ROUTER_LOSS, strategy=strategy, devices=pool.world_size)[0]
    expected = padded_runs.validate_own_loss(model=ROUTER_LOSS)
    assert got.keys() == expected.keys() == {"val_loss", "val_aux"}
    for key in expected:
        assert got[key] == pytest.approx(expected[key], rel=1e-5), key


def test_the_pipelined_router_loss_refuses_what_it_cannot_compute():
    """Under pp the router's loss is refused by name (before any data moves) with the schedules that split the
    backward (zero bubble, V); served at the others, and not needed for a model without it."""
    from lightning_par3d.engine.pipeline_router_loss import refusal

    lm = _built_from(ROUTER_LOSS)
    assert refusal(lm, "1f1b") is None and refusal(lm, "interleaved_1f1b") is None
    assert refusal(_built("qwen3_moe"), "zbv_zero_bubble") is None  # output_router_logits off
    for schedule in ("interleaved_zero_bubble", "zbv_zero_bubble", "dualpipev"):
        message = refusal(lm, schedule)
        what = f"pipeline_schedule={schedule!r}"
        assert message is not None and what in message and "output_router_logits=False" in message, message


def test_a_model_without_its_router_loss_is_not_routed_ahead(monkeypatch):
    """Routing ahead costs a forward of each later batch: only where the model adds its router's loss
    (``output_router_logits``, in its config or the call), never for a MoE model trained without it."""
    import torch

    from lightning_par3d.engine import router_loss
    from lightning_par3d.engine.tokens import BatchTokens

    lm = _built("qwen3_moe")
    ids = torch.randint(0, 64, (2, 8))
    batch = {"input_ids": ids}
    entry = BatchTokens(total=16, batches=2, counted=8, index=0, batch=batch, later=({"input_ids": ids.flip(0)},))
    router_loss.install(lm, 1, lambda: None, lambda: 2, window=lambda: entry)
    routed = []
    monkeypatch.setattr(router_loss._GlobalRouterLoss, "route_ahead", lambda *a: routed.append(a[4].index))
    lm.model.train()
    lm.model(input_ids=ids)
    assert routed == []
    lm.model(input_ids=ids, output_router_logits=True)
    assert routed == [0]
    # an epoch's last window of one batch: nothing to route, and nothing left of the window before
    monkeypatch.undo()
    state = router_loss._GlobalRouterLoss(print, 1, lambda: None, lambda: 2, lambda: None)
    state.ahead = [(torch.ones(4), torch.tensor(8.0))]
    alone = BatchTokens(total=8, batches=1, counted=8, index=0, batch=batch)
    state.route_ahead(lambda *a, **k: pytest.fail("routed a batch ahead"), (), {"input_ids": ids}, alone, dict)
    assert state.ahead == []


@functools.cache
def accumulated_router_loss_reference() -> dict:
    return padded_runs.run_reference("right", padded_runs.OwnLossLM, accumulate=2, model=ROUTER_LOSS)


JITTERED = {
    "architecture": "mixtral",
    "config_overrides": {**MOE["mixtral"]["config_overrides"], "output_router_logits": True,
                         "router_aux_loss_coef": 0.1, "router_jitter_noise": 0.1},
}  # fmt: skip
"""Mixtral with its router's loss and random jitter on the router's input in training."""


def test_the_router_loss_is_refused_where_par3d_cannot_see_the_global_batch(pool2):
    """Accumulated batches not read ahead (``loss_mean='microbatches'``), a router whose choices are random (a later
    batch routes otherwise in training than ahead), and pipeline stages (which never run the model's forward, where
    the loss is added): each refused, naming the fix, on every rank."""
    from tests.harness import RankError

    for strategy, accumulate, lm, model, message in (
        (dict(dp_shard=2, loss_mean="microbatches"), 2, padded_runs.OwnLossLM, ROUTER_LOSS,
         "par3d routes ahead from the"),
        (dict(dp_shard=2), 2, padded_runs.OwnLossLM, JITTERED, "batch 2 of the accumulation window routed its tokens "
         "otherwise than when par3d routed it ahead .* router jitter noise"),
        (dict(pp=2), 1, padded_runs.PaddedLM, ROUTER_LOSS, "this loss gets only the last stage's logits, so the "
         "router's loss would be left out. Call the model with labels="),
    ):  # fmt: skip
        with pytest.raises(RankError, match=message):
            run = dict(strategy=strategy, devices=2, side="right", module=lm)
            pool2.run(padded_runs.run_par3d, accumulate=accumulate, model=model, max_steps=1, **run)


# ---------------------------------------------------------------- other front-ends, checkpoints, export


def test_under_accelerate_and_fabric(pool4):
    """The README's Accelerate loop at dp_shard=2 × tp=2 and the same script under Fabric at pp=2 × tp=2, with the
    model's own plan, against the loop on one process."""
    from tests.hf_runs import accelerate_hf_loop, fabric_hf_loop

    model = MOE["qwen3_moe"]
    reference_loop = accelerate_hf_loop(None, model=model)
    got = pool4.run(accelerate_hf_loop, strategy=dict(dp_shard=2, tp=2), model=model)[0]
    assert_parity(got, reference_loop)
    got = pool4.run(fabric_hf_loop, strategy=dict(pp=2, tp=2), model=model)[0]
    assert_parity(got, reference_loop)


def test_expert_parallel_under_accelerate_and_fabric(pool4):
    """The README's Accelerate loop at dp_shard=4 × ep=2 and the same script under Fabric at pp=2 × dp_shard=2 ×
    ep=2, against the loop on one process."""
    from tests.hf_runs import accelerate_hf_loop, fabric_hf_loop

    model = MOE["qwen3_moe"]
    reference_loop = accelerate_hf_loop(None, model=model)
    got = pool4.run(accelerate_hf_loop, strategy=dict(dp_shard=4, ep=2), model=model)[0]
    assert_parity(got, reference_loop)
    got = pool4.run(fabric_hf_loop, strategy=dict(pp=2, dp_shard=2, ep=2), model=model)[0]
    assert_parity(got, reference_loop)


def test_a_checkpoint_resumes_at_another_layout_and_the_export_loads_in_transformers(pool4, tmp_path):
    """Saved at dp_shard=2 × tp=2 (each rank holding its interleaved part of every expert), resumed at
    pp=2 × dp_shard=2 and back, on the single-process trajectory; ``SavePretrained`` of a pp=2 × tp=2 run writes the
    experts as one 3-D tensor each, which ``AutoModelForCausalLM.from_pretrained`` loads into the trained weights,
    whose logits are par3d's."""
    import torch
    from transformers import AutoModelForCausalLM

    from tests.hf_runs import assert_resumes_both_ways

    model = MOE["qwen3_moe"]
    assert_resumes_both_ways(pool4, model, dict(dp_shard=2, tp=2, tp_plan="auto"), dict(pp=2, dp_shard=2), tmp_path)

    ids = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(7))
    export = tmp_path / "exported"
    piped = dict(pp=2, tp=2, tp_plan="auto")  # (no dp: every rank predicts the whole batch)
    trained = pool4.run(run_par3d, strategy=piped, devices=4, model=model, export_to=str(export), logits_of=ids)[0]
    reloaded = AutoModelForCausalLM.from_pretrained(export)
    for name, value in reloaded.state_dict().items():
        assert torch.equal(value, trained["params"][f"model.{name}"]), name
    with torch.no_grad():
        logits = reloaded(ids).logits
    torch.testing.assert_close(trained["logits"], logits, rtol=1e-5, atol=1e-5 * logits.abs().max().item())


@pytest.mark.parametrize(
    "name, strategy",
    [("qwen3_moe", dict(dp_shard=2, tp=2)), ("mixtral", dict(pp=2, tp=2)), ("qwen3_moe", dict(dp_shard=4, ep=2))],
    ids=["qwen3_moe-dp_shard2xtp2", "mixtral-pp2xtp2", "qwen3_moe-dp_shard4xep2"],
)
def test_a_per_expert_pretrained_checkpoint_is_read_into_each_ranks_expert_shards(pool4, tmp_path, name, strategy):
    """transformers' ``save_pretrained`` writes each expert apart (``experts.0.gate_proj.weight``; Mixtral's
    ``block_sparse_moe.experts.0.w1.weight``) and its ``from_pretrained`` fuses them: ``init="pretrained"`` reads,
    by the model's own conversion mapping, each rank's part of every fused expert tensor from those files (no rank
    builds the model), and trains on the trajectory of one process that starts from ``from_pretrained``; with
    ``init="rank0"`` rank 0 loads it with ``from_pretrained`` and broadcasts it, the same."""
    from safetensors import safe_open

    from tests.hf_runs import save_tiny_pretrained

    source = save_tiny_pretrained(tmp_path / "pretrained", MOE[name])
    saved = set()
    for file in source.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as handle:
            saved.update(handle.keys())
    assert any(".experts.0." in key for key in saved) and not any(key.endswith("gate_up_proj") for key in saved)
    model = {"pretrained_path": str(source)}
    reference_run = run_reference(model)
    for init in ("pretrained", "rank0"):
        ranks = pool4.run(run_par3d, strategy=dict(tp_plan="auto", init=init, **strategy), devices=4, model=model)
        assert_parity(ranks[0], reference_run)
        if init == "pretrained":
            assert all(rank["real_bytes_built"] == 0 for rank in ranks), "a rank built real parameters"


def test_the_estimator_runs_experts_in_fp32_and_bf16():
    """torch 2.13's fake ``grouped_mm`` (transformers' experts call it) accepts bf16 only; par3d shapes its fp32
    output itself (``torch_private.fp32_grouped_mm_on_fake``), as the CPU kernel computes it: the experts are
    estimated in both, split over tp, at twice the bytes in fp32."""
    from lightning_par3d import Par3DConfig, estimate_memory
    from lightning_par3d.distributed.fakeworld import forget_meshes

    config = Par3DConfig(dp_shard=2, tp=2, tp_plan="auto")
    with forget_meshes():
        full = estimate_memory(module(MOE["qwen3_moe"]), config, 4, (8, 32))
        split = estimate_memory(module(MOE["qwen3_moe"]), config, 4, (8, 32), precision="bf16-true")
        whole = estimate_memory(module(MOE["qwen3_moe"]), Par3DConfig(dp_shard=2), 2, (8, 32), precision="bf16-true")
    assert 0 < split.rows[0].state.params < whole.rows[0].state.params  # the experts, most of the model, cut over tp
    assert full.rows[0].state.params == 2 * split.rows[0].state.params


def _measured_memory(strategy: dict, precision: str) -> dict:
    """A pool job: a run's model state before its second step, and its batches' peak saved activations."""
    from tests.test_estimate import MemoryProbe

    probe = MemoryProbe()
    run = dict(devices=4, model=MOE["qwen3_moe"], precision=precision, max_steps=3, extra_callbacks=[probe])
    run_par3d(strategy=strategy, **run)
    return {"state": probe.state, "activations": probe.activations}


def test_the_estimate_of_expert_parallel_matches_a_measured_run(pool4):
    """Under ep the estimator runs the run's own build (the experts split over ep, FSDP2 over the ranks sharing
    them) on fake tensors, the routing taken as balanced: the model state per rank to the byte, the activations
    (the dispatch buffers included) within the routing's imbalance; in fp32, the default (the experts' grouped_mm
    shaped by par3d where torch's fake one refuses fp32; bf16's estimate: the test above)."""
    from lightning_par3d import Par3DConfig, estimate_memory
    from lightning_par3d.distributed.fakeworld import forget_meshes
    from tests.gpt_runs import GLOBAL_BATCH

    strategy, precision = dict(dp_shard=4, ep=2), "32-true"
    measured = pool4.run(_measured_memory, strategy=strategy, precision=precision)
    with forget_meshes():
        batch = (GLOBAL_BATCH // 4, module().hparams.block_size)
        estimate = estimate_memory(module(MOE["qwen3_moe"]), Par3DConfig(**strategy), 4, batch, precision=precision)
    row = estimate.rows[0]
    for got in measured:
        assert row.state == got["state"]
        assert abs(row.activations - got["activations"]) <= 0.15 * got["activations"], (row, got)


def test_a_dry_run_of_expert_parallel_at_64_ranks_holds_the_estimators_model_state(new_interpreter):
    """``par3d dry-run``'s function: rank 0 of dp_shard=64 × ep=4 builds its shards and runs a step over the fake
    backend (whose all-to-all delivers nothing: every rank taken to route as this one); its parameters, gradients
    and optimizer state equal the estimator's (bf16: the estimator's fake grouped_mm)."""
    import torch

    from lightning_par3d import Par3DConfig, estimate_memory
    from lightning_par3d.distributed.fakeworld import forget_meshes
    from lightning_par3d.tools.dry_run import dry_run

    config = Par3DConfig(dp_shard=64, ep=4)
    batch = torch.randint(0, 256, (2, 33))
    result = dry_run(
        module(MOE["qwen3_moe"]), config, 64, (batch[:, :-1], batch[:, 1:]), ranks=[0], precision="bf16-true"
    )
    with forget_meshes():
        row = estimate_memory(module(MOE["qwen3_moe"]), config, 64, (2, 32), precision="bf16-true").rows[0]
    (ran,) = result.ranks
    assert (ran.params, ran.grads, ran.optimizer) == (row.state.params, row.state.grads, row.state.optimizer)
    assert ran.activations_peak > 0


def _another_router_loss_on_rank_1(**run: object) -> dict:
    """A pool job: ``padded_runs.run_par3d`` with the model's load-balancing loss doubled on rank 1 only."""
    import os

    from transformers.models.qwen3_moe import modeling_qwen3_moe as home

    own = home.load_balancing_loss_func
    if os.environ.get("RANK") == "1":
        home.load_balancing_loss_func = lambda *args, **kwargs: 2 * own(*args, **kwargs)
    try:
        return padded_runs.run_par3d(**run)
    finally:
        home.load_balancing_loss_func = own


def test_a_router_loss_par3d_does_not_know_is_refused_on_every_rank(pool2):
    """The model's own function is compared with par3d's on the first step; where it differs (here on one rank
    only), every rank raises, none waits in the next collective."""
    from tests.harness import RankError

    run = dict(strategy=dict(dp_shard=2), devices=2, side="right", module=padded_runs.OwnLossLM, model=ROUTER_LOSS)
    with pytest.raises(RankError, match="differs from the Switch Transformer loss par3d computes") as info:
        pool2.run(_another_router_loss_on_rank_1, max_steps=1, **run)
    assert info.value.all_ranks_failed


# ---------------------------------------------------------------- the planner and layout="auto"


def test_the_plan_of_a_moe_model_searches_ep_and_its_memory_is_the_estimators():
    """A tiny Qwen3-MoE (4 experts per layer) on 4 ranks: ep = 2 and 4 are searched beside the dense layouts, each
    where it divides dp_shard (FSDP2 alone under ep); every kind of ep row's memory is the estimator's (fp32: the
    experts' grouped_mm shaped by par3d), and its step prices the blocks' all-to-alls."""
    from lightning_par3d import estimate_memory
    from lightning_par3d.distributed.fakeworld import forget_meshes
    from lightning_par3d.planning import plan

    table = plan(module(MOE["qwen3_moe"]), 4, 4, "1GiB", global_batch=8, seq_len=32, machine="h100-sxm-8")
    assert "(ep = 2, 4 searched too: CausalLMModule has 4 experts per layer.)" in table.notes
    experts = [row for row in table.fitting if row.layout.ep > 1]
    assert {(row.layout.ep, row.layout.dp_shard) for row in experts} >= {(2, 2), (2, 4), (4, 4)}
    assert all(row.layout.zero == 3 and row.layout.dp_shard % row.layout.ep == 0 for row in experts)
    assert all(row.time.tp_comm > 0 for row in experts if row.layout.tp == 1)  # the all-to-alls alone
    seen = set()
    for row in experts:
        kind = (row.layout.pp, row.layout.tp, row.layout.ep, row.layout.dp_shard, row.layout.dp_replicate)
        if kind in seen:
            continue
        seen.add(kind)
        with forget_meshes():
            expected = estimate_memory(module(MOE["qwen3_moe"]), row.config, 4, (8 // row.layout.dp, 32))
        assert row.memory == expected, row.describe()
    assert len(seen) >= 4
    assert "ep" in experts[0].describe() and experts[0].strategy_arguments()["ep"] == experts[0].layout.ep


def test_auto_keeps_a_pinned_ep_and_trains_on_the_single_process_trajectory(pool4, tmp_path):
    """``layout="auto"`` with ``ep=2``: the layouts whose dp_shard ep divides are planned and 2 measured, in the same
    processes; the one trained splits the experts over 2 ranks and reaches one process's losses and parameters."""
    strategy = dict(layout="auto", ep=2, measure=2, plan_machine="h100-sxm-8")
    results = pool4.run(run_par3d, strategy=strategy, devices=4, model=MOE["qwen3_moe"], rank_batch=2,
                        default_root_dir=str(tmp_path))  # fmt: skip
    layout = results[0]["layout"]
    assert all(result["layout"] == layout for result in results)
    assert layout.ep == 2 and layout.dp_shard % 2 == 0, layout
    log = pool4.log_tail(0, chars=20000)
    assert "par3d layout='auto': chose " in log and "ep=2" in log, log
    assert set(results[0]["split_over_ep"].values()) == {2}
    assert_parity(results[0], reference("qwen3_moe"))
