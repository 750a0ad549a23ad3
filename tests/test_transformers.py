"""Hugging Face transformers models, unchanged: their own tensor-parallel plans (transformers 5 names, packed
projections, tied embeddings), pipelined by par3d itself, pretrained weights read into each rank's shards and
exported back as a ``save_pretrained`` directory. Every model is a tiny config built here; nothing is downloaded.

Each parity case trains 5 AdamW steps and matches the single-process run (fp32, rtol 1e-4) on every loss and every
parameter (:func:`tests.conftest.assert_parity`)."""

from __future__ import annotations

import functools

import pytest
import torch

from tests.conftest import assert_parity
from tests.harness import RankError
from tests.hf_runs import (
    PACKED_PLAN,
    accelerate_hf_loop,
    assert_resumes_both_ways,
    module,
    run_par3d,
    run_reference,
    save_tiny_pretrained,
)

NO_DROPOUT = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
ARCHITECTURES = {
    "llama": {},
    "qwen2": dict(architecture="qwen2"),
    "mistral": dict(architecture="mistral"),
    "gpt2": dict(architecture="gpt2", config_overrides=NO_DROPOUT),
    "phi3": dict(architecture="phi3"),
    "qwen3": dict(architecture="qwen3", config_overrides=dict(head_dim=8)),
    "qwen2-tied": dict(architecture="qwen2", tie_word_embeddings=True),
    "llama-4-layers": dict(num_hidden_layers=4),
    "qwen2-4-layers": dict(architecture="qwen2", num_hidden_layers=4),
}


@functools.cache
def reference(name: str) -> dict:
    return run_reference(ARCHITECTURES[name])


# ---------------------------------------------------------------- tensor parallelism with the model's own plan


def test_llama_own_plan_at_tp2(pool2):
    got = pool2.run(run_par3d, strategy=dict(tp=2, tp_plan="auto"), devices=2, model=ARCHITECTURES["llama"])[0]
    assert_parity(got, reference("llama"))


@pytest.mark.parametrize(
    "name, strategy",
    [
        pytest.param("llama", dict(dp_shard=2, tp=2), id="llama-dp2xtp2"),
        pytest.param("qwen2-tied", dict(dp_shard=2, tp=2), id="qwen2-tied-embeddings-dp2xtp2"),
        pytest.param("phi3", dict(dp_shard=2, tp=2), id="phi3-own-plan-dp2xtp2"),
    ],
)
def test_own_plan_at_four_ranks(pool4, name, strategy):
    """``tp_plan = "auto"`` on the LightningModule: the transformers model's own plan (Phi-3's fused ``qkv_proj`` and
    ``gate_up_proj`` with ``colwise_gather_output`` / ``rowwise_split_input``; Qwen2's LM head tied to its embedding,
    which par3d shards alike as one DTensor)."""
    got = pool4.run(run_par3d, strategy=strategy, devices=4, model=ARCHITECTURES[name])[0]
    assert_parity(got, reference(name))


def test_llama_own_plan_under_hsdp_and_tp(pool8):
    strategy = dict(dp_replicate=2, dp_shard=2, tp=2, tp_plan="auto")
    assert_parity(pool8.run(run_par3d, strategy=strategy, devices=8)[0], reference("llama"))


def test_packed_gate_up_projection_at_tp2_then_resume_at_another_layout(pool4, tmp_path):
    """A Phi-3 plan with ``packed_colwise`` ``gate_up_proj`` (each rank holds [gate_r; up_r]) at dp2×tp2: parity;
    its checkpoint (the interleaved shards saved as the whole tensor's rows) resumes at pp2×dp2 and continues the
    single-process trajectory; a checkpoint saved at pp2×dp2 resumes under the packed plan."""
    phi3 = ARCHITECTURES["phi3"]
    packed = dict(dp_shard=2, tp=2, tp_plan=dict(PACKED_PLAN))
    assert_parity(pool4.run(run_par3d, strategy=packed, devices=4, model=phi3)[0], reference("phi3"))

    assert_resumes_both_ways(pool4, phi3, packed, dict(pp=2, dp_shard=2), tmp_path)


def test_packed_gate_up_projection_pipelined_at_pp2_x_tp2(pool4):
    """The last stage's ranks (2, 3) do not include rank 0, which alone read the initial weights: each rank takes
    its interleaved shards of them all the same."""
    got = pool4.run(
        run_par3d, strategy=dict(pp=2, tp=2, tp_plan=dict(PACKED_PLAN)), devices=4, model=ARCHITECTURES["phi3"]
    )[0]
    assert {n.rsplit(".", 2)[-2] for n in got["split_over_tp"] if "gate_up_proj" in n} == {"gate_up_proj"}
    assert_parity(got, reference("phi3"))


# ---------------------------------------------------------------- pipelining an unmodified model


@pytest.mark.parametrize("name", ["llama", "qwen2", "gpt2"])
def test_pipeline_pp2_1f1b(pool2, name):
    got = pool2.run(run_par3d, strategy=dict(pp=2), devices=2, model=ARCHITECTURES[name])[0]
    assert_parity(got, reference(name))


@pytest.mark.parametrize(
    "name, strategy",
    [
        pytest.param("llama", dict(pp=2, tp=2, tp_plan="auto"), id="llama-pp2xtp2"),
        pytest.param("qwen2", dict(pp=2, tp=2, tp_plan="auto"), id="qwen2-pp2xtp2"),
        pytest.param("mistral", dict(pp=2, tp=2, tp_plan="auto"), id="mistral-pp2xtp2"),
        pytest.param("qwen3", dict(pp=2, tp=2, tp_plan="auto"), id="qwen3-q-k-norm-pp2xtp2"),
        pytest.param("phi3", dict(pp=2, tp=2, tp_plan="auto"), id="phi3-fused-pp2xtp2"),
        pytest.param("llama", dict(pp=2, dp_shard=2), id="llama-pp2xdp2"),
        pytest.param("qwen2", dict(pp=2, dp_shard=2, activation_checkpointing="full"), id="qwen2-pp2xdp2-ac"),
        pytest.param(
            "llama-4-layers", dict(pp=2, dp_shard=2, pipeline_schedule="interleaved_1f1b"), id="llama-interleaved"
        ),
        pytest.param(
            "qwen2-4-layers", dict(pp=2, tp=2, pipeline_schedule="interleaved_1f1b"), id="qwen2-interleaved-tp2"
        ),
    ],
)
def test_pipeline_at_four_ranks(pool4, name, strategy):
    got = pool4.run(run_par3d, strategy=strategy, devices=4, model=ARCHITECTURES[name])[0]
    assert_parity(got, reference(name))


def test_models_own_plan_under_pipelining_and_tensor_parallelism(pool4):
    """The module's ``tp_plan`` hook returns the transformers model's own plan (``dict(self.model.tp_plan)``) at
    pp2×tp2: each stage applies the entries of the modules it holds (the LM head's entry is skipped on the first
    stage, the embedding's on the last, where they are placeholders) and the run matches one process."""
    got = pool4.run(run_par3d, strategy=dict(pp=2, tp=2), devices=4, model=ARCHITECTURES["llama"], own_plan=True)[0]
    assert_parity(got, reference("llama"))


@pytest.mark.parametrize("own_plan", [True, False], ids=["own-plan", "tp_plan-auto"])
def test_models_own_plan_in_full_3d(pool8, own_plan):
    """pp2 × dp_shard2 × tp2 on 8 ranks, with the model's own plan from the module's hook and with ``"auto"``."""
    strategy = dict(pp=2, dp_shard=2, tp=2, **({} if own_plan else {"tp_plan": "auto"}))
    got = pool8.run(run_par3d, strategy=strategy, devices=8, model=ARCHITECTURES["llama"], own_plan=own_plan)[0]
    assert_parity(got, reference("llama"))


def test_plan_entry_matching_nothing_on_any_stage_is_refused_by_name(pool4):
    """Skipping the entries of modules another stage holds does not hide a pattern that matches nothing at all."""
    plan = {"lm_head": "colwise_gather_output", "model.layers.*.self_attn.qq_proj": "colwise"}
    with pytest.raises(RankError, match=r"'model\.layers\.\*\.self_attn\.qq_proj' matches no module") as info:
        pool4.run(run_par3d, strategy=dict(pp=2, tp=2, tp_plan=plan), devices=4, model=ARCHITECTURES["llama"])
    assert info.value.all_ranks_failed


def test_tied_embeddings_are_refused_under_pipelining():
    from lightning_par3d.pipeline.transformers_stages import check_pipelinable

    lm = module(ARCHITECTURES["qwen2-tied"])
    lm.configure_model()
    with pytest.raises(ValueError, match="tie_word_embeddings"):
        check_pipelinable(lm.model)


def test_tied_embeddings_under_pipelining_fail_the_same_way_on_every_rank(pool2):
    with pytest.raises(RankError, match="tie_word_embeddings=False") as info:
        pool2.run(run_par3d, strategy=dict(pp=2), devices=2, model=ARCHITECTURES["qwen2-tied"])
    assert info.value.all_ranks_failed


# ---------------------------------------------------------------- weights in and out


def test_pretrained_round_trip_at_pp2_tp2(pool4, tmp_path):
    """A tiny random model written by ``save_pretrained`` (several safetensors files) is read into par3d at
    pp2×tp2 without any rank building or reading the whole model; its weights equal ``from_pretrained``'s bit for
    bit; 3 steps of training match one process that starts from ``from_pretrained``; ``SavePretrained`` writes a
    directory that ``AutoModelForCausalLM.from_pretrained`` loads into the trained weights, whose logits equal
    par3d's; the CLI converts the par3d checkpoint of the same run into the same weights."""
    from transformers import AutoModelForCausalLM

    from lightning_par3d.tools.export_hf import main as convert

    source = save_tiny_pretrained(tmp_path / "pretrained")
    assert len(list(source.glob("*.safetensors"))) > 1, "the checkpoint should be sharded over several files"
    model = {"pretrained_path": str(source)}
    strategy = dict(pp=2, tp=2, tp_plan="auto", init="pretrained")
    hf = AutoModelForCausalLM.from_pretrained(source)
    total = sum(p.numel() * p.element_size() for p in hf.parameters())

    loaded = pool4.run(run_par3d, strategy=strategy, devices=4, model=model, max_steps=0)
    for rank in loaded:
        assert rank["real_bytes_built"] == 0, "a rank built real parameters"
        assert 0 < rank["bytes_read"] < 0.6 * total, (rank["bytes_read"], total)
        assert 0 < rank["bytes_held"] < 0.6 * total, (rank["bytes_held"], total)
    expected = {f"model.{k}": v for k, v in hf.state_dict().items()}
    assert sorted(loaded[0]["params"]) == sorted(expected)
    for name, value in expected.items():
        assert torch.equal(loaded[0]["params"][name], value), name

    ids = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(7))
    export, checkpoint = tmp_path / "exported", tmp_path / "trained.ckpt"
    ranks = pool4.run(
        run_par3d,
        strategy=strategy,
        devices=4,
        model=model,
        max_steps=3,
        export_to=str(export),
        checkpoint_to=str(checkpoint),
        logits_of=ids,
    )
    trained = ranks[0]
    assert_parity(trained, run_reference(model, max_steps=3))
    every_rank_logits = [rank["logits"] for rank in ranks]
    assert all(logits is not None for logits in every_rank_logits)  # under pp: broadcast from the last stage

    reloaded = AutoModelForCausalLM.from_pretrained(export)
    for name, value in reloaded.state_dict().items():
        assert torch.equal(value, trained["params"][f"model.{name}"]), name
    with torch.no_grad():
        logits = reloaded(ids).logits
    for got in every_rank_logits:
        torch.testing.assert_close(got, logits, rtol=1e-5, atol=1e-5 * logits.abs().max().item())

    converted = tmp_path / "converted"
    assert convert([str(checkpoint), str(converted), "--config", str(source)]) == 0
    again = AutoModelForCausalLM.from_pretrained(converted).state_dict()
    assert all(torch.equal(again[name], value) for name, value in reloaded.state_dict().items())


def test_pretrained_models_start_training_in_train_mode(tmp_path):
    """``from_pretrained`` returns a model in eval mode; the example's module trains it in train mode, as it does a
    model built with ``from_config`` (par3d's ``init="pretrained"``)."""
    source = save_tiny_pretrained(tmp_path / "pretrained")
    for path in (str(source), None):
        lm = module({"pretrained_path": path})
        lm.configure_model()
        assert all(sub.training for sub in lm.modules()), path


def test_pretrained_directory_lacking_a_weight_is_refused_by_name(tmp_path):
    from safetensors.torch import load_file, save_file

    from lightning_par3d.checkpoint.pretrained import load_pretrained

    source = save_tiny_pretrained(tmp_path / "pretrained")
    damaged = next(f for f in sorted(source.glob("*.safetensors")) if "q_proj" in str(load_file(f).keys()))
    tensors = load_file(damaged)
    dropped = next(k for k in tensors if "q_proj" in k)
    save_file({k: v for k, v in tensors.items() if k != dropped}, damaged, metadata={"format": "pt"})
    lm = module({"pretrained_path": str(source)})
    lm.configure_model()
    with pytest.raises(ValueError, match=dropped.replace(".", r"\.")):
        load_pretrained(lm, str(source))


def test_pretrained_needs_a_directory():
    from lightning_par3d import Par3DConfig, resolve_layout
    from lightning_par3d.checkpoint.pretrained import pretrained_path

    lm = module()
    lm.configure_model()
    with pytest.raises(ValueError, match="local save_pretrained directory"):
        pretrained_path(lm, "/nonexistent/llama")
    with pytest.raises(ValueError, match="set init='pretrained'"):
        resolve_layout(Par3DConfig(pretrained_path="/some/dir"))


# ---------------------------------------------------------------- Accelerate


def test_accelerate_trains_an_unmodified_llama_at_dp2_tp2(pool4):
    """``Par3DAccelerator(par3d=Par3DConfig(dp_shard=2, tp=2, tp_plan="auto"))`` with a plain
    ``AutoModelForCausalLM`` and a loss on its output."""
    got = pool4.run(accelerate_hf_loop, strategy=dict(dp_shard=2, tp=2))[0]
    assert_parity(got, accelerate_hf_loop(None))


def test_accelerate_pipelines_an_unmodified_llama(pool4):
    got = pool4.run(accelerate_hf_loop, strategy=dict(pp=2, tp=2))[0]
    assert_parity(got, accelerate_hf_loop(None))


def test_unknown_and_expert_parallel_styles_in_a_transformers_plan_are_named():
    from lightning_par3d.parallel.tensor_parallel import expand_plan

    lm = module()
    lm.configure_model()
    with pytest.raises(ValueError, match="'colwise_sideways' is not a tensor-parallel style"):
        expand_plan(lm, {"model.layers.*.self_attn.q_proj": "colwise_sideways"})
    with pytest.raises(ValueError, match="'ep_dispatch_experts' is expert-parallel token dispatch, which par3d's"):
        expand_plan(lm, {"model.layers.*.mlp": "ep_dispatch_experts"})
