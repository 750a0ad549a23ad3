"""Tensor-parallel plans: patterns, checks against the model, and each style's numerics against one process."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from examples.gpt import GPT, GPT_TP_PLAN, GPTConfig, GPTModule
from lightning_par3d.parallel.tensor_parallel import check_divisibility, expand_plan, find_plan
from lightning_par3d.utils.patterns import matches
from tests.harness import RankError


def meta_gpt(**kw: int) -> GPT:
    with torch.device("meta"):
        return GPT(GPTConfig(**kw))


def test_patterns_match_trailing_segments():
    assert matches("h.*.mlp.c_fc", "model.transformer.h.3.mlp.c_fc")
    assert matches("lm_head", "model.lm_head")
    assert not matches("h.*.mlp.c_fc", "model.transformer.h.3.mlp.c_proj")
    assert not matches("mlp.c_fc.extra", "c_fc")
    assert not matches("h.*", "model.transformer.h.3.mlp")  # * is one segment and the match is anchored at the end


def test_gpt_plan_expands_to_every_block():
    styles = expand_plan(meta_gpt(n_layer=3), GPT_TP_PLAN)
    assert styles["transformer.h.2.attn.q_proj"] == "colwise"
    assert styles["transformer.h.0.mlp.c_proj"] == "rowwise"
    assert styles["lm_head"] == "colwise_rep"
    assert len(styles) == 2 + 3 * 6


def test_a_transformers_plan_works_unchanged():
    """The exact strings of a Hugging Face Llama `base_model_tp_plan`, on a module tree with Llama's names."""
    hf_plan = {
        "layers.*.self_attn.q_proj": "colwise",
        "layers.*.self_attn.k_proj": "colwise",
        "layers.*.self_attn.v_proj": "colwise",
        "layers.*.self_attn.o_proj": "rowwise",
        "layers.*.mlp.gate_proj": "colwise",
        "layers.*.mlp.up_proj": "colwise",
        "layers.*.mlp.down_proj": "rowwise",
    }

    class Attn(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(8, 8) for _ in range(4))

    class MLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate_proj, self.up_proj, self.down_proj = nn.Linear(8, 16), nn.Linear(8, 16), nn.Linear(16, 8)

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.self_attn, self.mlp = Attn(), MLP()

    model = nn.Module()
    model.model = nn.Module()
    model.model.layers = nn.ModuleList([Layer(), Layer()])
    styles = expand_plan(model, hf_plan)
    assert styles["model.layers.1.self_attn.o_proj"] == "rowwise"
    assert len(styles) == 14


def test_pattern_matching_nothing_names_the_pattern_and_the_real_names():
    with pytest.raises(ValueError, match=re.escape("tp_plan pattern 'blocks.*.fc' matches no module of GPT")) as err:
        expand_plan(meta_gpt(), {"blocks.*.fc": "colwise"})
    assert "Module names look like: transformer, transformer.wte" in str(err.value)


def test_unknown_style_and_conflicting_patterns():
    with pytest.raises(ValueError, match="'lm_head'\\]='vocab' is not a tensor-parallel style"):
        expand_plan(meta_gpt(), {"lm_head": "vocab"})
    with pytest.raises(ValueError, match="matched with two styles, 'colwise' and 'rowwise'"):
        expand_plan(meta_gpt(), {"h.*.mlp.c_fc": "colwise", "mlp.c_fc": "rowwise"})


def test_tp_must_divide_the_split_dimension():
    model = meta_gpt(vocab_size=250)
    with pytest.raises(
        ValueError, match=re.escape("tp=4 does not divide transformer.wte.num_embeddings=250 that style")
    ) as e:
        check_divisibility(model, expand_plan(model, GPT_TP_PLAN), tp=4)
    assert "Choose tp among [1, 2, 5, 10, 25, 50, 125, 250], or resize the layer" in str(e.value)


def test_tp_must_divide_the_head_count():
    model = meta_gpt(n_embd=48, n_head=6)
    with pytest.raises(
        ValueError, match=re.escape("tp=4 does not divide the head count transformer.h.0.attn.n_head=6")
    ) as e:
        check_divisibility(model, expand_plan(model, GPT_TP_PLAN), tp=4)
    assert "Choose tp among [1, 2, 3, 6]" in str(e.value)


def test_splitting_styles_need_linear_or_embedding():
    model = meta_gpt()
    with pytest.raises(
        ValueError, match=re.escape("'transformer.ln_f' is a LayerNorm; style 'colwise' applies to nn.Linear")
    ):
        check_divisibility(model, expand_plan(model, {"ln_f": "colwise"}), tp=2)


def test_find_plan_sources():
    class WithAttr(nn.Module):
        tp_plan = {"a": "colwise"}

    class WithHook(nn.Module):
        def tp_plan(self) -> dict[str, str]:
            return {"b": "rowwise"}

    class Bad(nn.Module):
        tp_plan = ["a"]

    assert find_plan(WithAttr(), None) == {"a": "colwise"}
    assert find_plan(WithHook(), None) == {"b": "rowwise"}
    assert find_plan(WithAttr(), {"c": "replicate"}) == {"c": "replicate"}
    assert find_plan(nn.Linear(1, 1), None) == {}
    with pytest.raises(TypeError, match=re.escape("Bad.tp_plan must be a dict")):
        find_plan(Bad(), None)


# ---------------------------------------------------------------- multi-process


class SeqMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc_in, self.fc_out = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc_out(torch.relu(self.fc_in(x)))  # (B, T / tp, 8) after rowwise_seq


class Experts(nn.Module):
    """A mixture-of-experts block's experts as transformers writes them: 3-D weights, one slice per expert
    (``gate_up_proj`` = [gate; up]), ``forward(hidden_states, top_k_index, top_k_weights)`` over flat tokens."""

    def __init__(self, experts: int = 3, width: int = 8, hidden: int = 16) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(experts, 2 * hidden, width) * 0.3)
        self.down_proj = nn.Parameter(torch.randn(experts, width, hidden) * 0.3)

    def forward(self, h: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(h)
        for e in range(self.gate_up_proj.shape[0]):
            token, slot = torch.where(top_k_index == e)
            gate, up = nn.functional.linear(h[token], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = nn.functional.linear(nn.functional.silu(gate) * up, self.down_proj[e])
            out = out.index_add(0, token, y * top_k_weights[token, slot, None])
        return out


class StyleNet(nn.Module):
    """Exercises the styles: vocab- and width-parallel embeddings, replicated norm, colwise→rowwise pairs,
    rowwise_split_input on a replicated input, a sequence-parallel norm between rowwise_seq and colwise_seq, a
    sequence-parallel region entered by sequence_shard, its MLP gathering once (gather_sequence), another running on
    the whole sequence under a plain plan (whole_sequence), left through a colwise_seq_gather_output head, a packed
    [gate; up] projection feeding a rowwise one and another feeding a packed_rowwise one, a per-head norm whose
    gradient is summed over the ranks, top-2 of 3 experts cut along their hidden size (moe_tp_experts, its 3-D
    weights split by entries naming them) behind a replicated router, and a gathered head; 4.x names beside 5.x
    ones."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.emb_cols = nn.Embedding(16, 8)
        self.norm = nn.LayerNorm(8)
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)
        self.mix = nn.Linear(8, 8)
        self.sp_in = nn.Linear(8, 16)
        self.sp_out = nn.Linear(16, 8)
        self.sp_norm = nn.LayerNorm(8)
        self.sp_up = nn.Linear(8, 16)
        self.sp_down = nn.Linear(16, 8)
        self.gate_up = nn.Linear(8, 32)  # [gate (16); up (16)]
        self.gated_down = nn.Linear(16, 8)
        self.pair = nn.Linear(8, 32)  # [a (16); b (16)]
        self.pair_down = nn.Linear(32, 8)  # its input is [a | b]
        self.heads = nn.Linear(8, 16)  # 4 heads of 4
        self.head_norm = nn.LayerNorm(4)  # per head, on each rank's own heads
        self.heads_out = nn.Linear(16, 8)
        self.seq_enter = nn.Identity()  # the first module of a sequence-parallel region: gets its shard
        self.seq_norm = nn.LayerNorm(8)
        self.seq_mlp = SeqMLP()  # gathers the sequence once for its column-wise projection
        self.seq_whole = SeqMLP()  # runs on the whole sequence under its plain plan, its output cut to the shard
        self.seq_norm2 = nn.LayerNorm(8)
        self.seq_head = nn.Linear(8, 8)
        self.router = nn.Linear(8, 3, bias=False)
        self.experts = Experts()
        self.head = nn.Linear(8, 16)

    plan = {
        "emb": "embedding_rowwise",
        "emb_cols": "embedding_colwise",
        "norm": "replicate",
        "up": "colwise",
        "down": "rowwise",
        "mix": "rowwise_split_input",
        "sp_in": "local_colwise",
        "sp_out": "rowwise_seq",
        "sp_norm": "sequence_parallel",
        "sp_up": "colwise_seq",
        "sp_down": "local_rowwise",
        "gate_up": "packed_colwise",
        "gated_down": "rowwise",
        "pair": "packed_colwise",
        "pair_down": "local_packed_rowwise",
        "heads": "colwise",
        "head_norm": "replicated_with_grad_allreduce",
        "heads_out": "rowwise",
        "seq_enter": "sequence_shard",
        "seq_norm": "sequence_parallel",
        "seq_mlp": "gather_sequence",
        "seq_mlp.fc_in": "colwise",
        "seq_mlp.fc_out": "rowwise_seq",
        "seq_whole": "whole_sequence",
        "seq_whole.fc_in": "colwise",
        "seq_whole.fc_out": "rowwise",
        "seq_norm2": "sequence_parallel",
        "seq_head": "colwise_seq_gather_output",
        "experts": "moe_tp_experts",
        "experts.gate_up_proj": "packed_colwise",
        "experts.down_proj": "rowwise",
        "head": "colwise_gather_output",
    }

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.norm(self.emb(idx) + self.emb_cols(idx))  # (B, T, 8)
        x = x + self.down(torch.relu(self.up(x)))  # (B, T, 8)
        x = x + self.mix(x)  # (B, T, 8)
        s = self.sp_norm(self.sp_out(torch.relu(self.sp_in(x))))  # (B, T / tp, 8) sequence-sharded
        x = x + self.sp_down(torch.relu(self.sp_up(s)))  # (B, T, 8)
        gate, up = self.gate_up(x).chunk(2, dim=-1)  # (B, T, 16 / tp) each: this rank's matching parts
        x = x + self.gated_down(torch.nn.functional.silu(gate) * up)  # (B, T, 8)
        x = x + self.pair_down(torch.tanh(self.pair(x)))  # (B, T, 8)
        h = self.heads(x)  # (B, T, 16 / tp): this rank's heads
        h = self.head_norm(h.view(*h.shape[:2], -1, 4)).flatten(2)  # (B, T, 16 / tp)
        x = x + self.heads_out(h)  # (B, T, 8)
        s = self.seq_enter(x)  # (B, T / tp, 8): this rank's sequence shard
        s = s + self.seq_mlp(self.seq_norm(s))  # (B, T / tp, 8)
        s = s + self.seq_whole(s)  # (B, T / tp, 8): the whole sequence inside, this rank's shard out
        x = x + self.seq_head(self.seq_norm2(s))  # (B, T, 8): gathered
        flat = x.reshape(-1, 8)
        weights, chosen = torch.topk(torch.softmax(self.router(flat), dim=-1), 2, dim=-1)  # the same on every rank
        x = x + self.experts(flat, chosen, weights).view_as(x)  # (B, T, 8): each rank's part of every expert, summed
        return self.head(x)  # (B, T, 16)


def style_parity_job(plan: dict[str, str]) -> float:
    """Trains StyleNet for 5 AdamW steps under the plan at tp=world and once unsharded; returns the max relative
    difference of the losses and parameters."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_par3d.parallel.tensor_parallel import apply_tensor_parallel

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    ref = StyleNet()
    par = StyleNet()
    par.load_state_dict(ref.state_dict())
    apply_tensor_parallel(par, mesh, expand_plan(par, plan))
    worst = 0.0
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ref, par)]
    for step in range(5):
        idx = torch.randint(0, 16, (4, 6), generator=torch.Generator().manual_seed(step))
        losses = []
        for model, opt in zip((ref, par), opts, strict=True):
            loss = nn.functional.cross_entropy(model(idx).reshape(-1, 16), idx.roll(1, 1).reshape(-1))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        worst = max(worst, abs(losses[0] - losses[1]) / abs(losses[0]))
    for p_ref, p_par in zip(ref.parameters(), par.parameters(), strict=True):
        full = p_par.full_tensor() if hasattr(p_par, "full_tensor") else p_par
        worst = max(worst, ((full - p_ref).norm() / p_ref.norm()).item())
    return worst


def test_every_style_matches_one_process(pool2):
    from lightning_par3d.config.tp_vocabulary import CANONICAL_STYLES, canonical

    # Every style but the two that need no split of their own (tested below on local shards).
    assert {canonical(s) for s in StyleNet.plan.values()} == set(CANONICAL_STYLES) - {"all_reduce", "local_params"}
    worst = pool2.run(style_parity_job, plan=StyleNet.plan)
    assert max(worst) <= 1e-5, worst


def local_styles_job() -> dict:
    """all_reduce sums each rank's partial output (backward: the identity); local_params computes on local shards."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel import parallelize_module

    from lightning_par3d.parallel.tp_styles import build_style

    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))

    class RankScaled(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * (rank + 1)  # a partial result: every rank's part of a sum

    scaled = RankScaled()
    parallelize_module(scaled, mesh, build_style("all_reduce", scaled))
    x = torch.ones(2, 3, requires_grad=True)
    out = scaled(x)
    out.sum().backward()
    linear = nn.Linear(4, 6, bias=False)
    torch.manual_seed(0)
    whole = torch.randn(6, 4)
    linear.weight = nn.Parameter(distribute_tensor(whole, mesh, [Shard(0)]))
    parallelize_module(linear, mesh, build_style("local_params", linear))
    y = linear(torch.ones(1, 4))
    return {
        "sum": out[0, 0].item(),
        "grad": x.grad[0, 0].item(),
        "local": torch.allclose(y, torch.ones(1, 4) @ whole.chunk(world)[rank].T),
        "expected_sum": float(sum(range(1, world + 1))),
        "rank": rank,
    }


def test_all_reduce_and_local_params_styles(pool2):
    for got in pool2.run(local_styles_job):
        assert got["sum"] == got["expected_sum"]
        assert got["grad"] == got["rank"] + 1  # the identity backward: each rank's own factor
        assert got["local"]


def test_transformers_names_and_refusals():
    from lightning_par3d.config.tp_vocabulary import canonical

    assert canonical("colwise_rep") == "colwise_gather_output"
    assert canonical("rowwise_rep") == "rowwise_split_input"
    assert canonical("gather") == "all_reduce"
    with pytest.raises(ValueError, match="'grouped_gemm' is expert-parallel grouped GEMM weights, which par3d's"):
        expand_plan(meta_gpt(), {"lm_head": "grouped_gemm"})
    with pytest.raises(ValueError, match=r"'lm_head' has style 'moe_tp_experts'.*the plan names none of its param"):
        expand_plan(meta_gpt(), {"lm_head": "moe_tp_experts"})


def test_bad_plan_errors_on_every_rank_instead_of_hanging(pool4):
    """A plan problem found after the process group exists raises the same error on all ranks, before any
    collective, so the run ends at once with the message rather than waiting on a peer."""
    from tests.gpt_runs import run_par3d

    with pytest.raises(RankError) as err:
        pool4.run(run_par3d, strategy=dict(tp=4, tp_plan={"h.*.mlp.fc": "colwise"}), devices=4, timeout=120)
    assert err.value.all_ranks_failed
    assert "tp_plan pattern 'h.*.mlp.fc' matches no module of GPTModule" in err.value.exc_message


class InPlaceLogitsGPT(GPTModule):
    """Modifies the model's logits in place: the only way FSDP2's "returned a view tensor" warning could matter."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        logits = super().forward(idx)
        logits.mul_(0.5)
        return logits


def view_warning_job(in_place: bool) -> dict:
    import warnings

    import tests.gpt_runs as runs

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if not in_place:
            runs.run_par3d(strategy=dict(dp_shard=2, tp=2), devices=4, max_steps=1)
            return {"warnings": [str(w.message) for w in caught], "error": None}
        runs.GPTModule = InPlaceLogitsGPT
        try:
            runs.run_par3d(strategy=dict(dp_shard=2, tp=2), devices=4, max_steps=1)
        except RuntimeError as error:
            return {"warnings": [], "error": str(error)}
        finally:
            runs.GPTModule = GPTModule
    return {"warnings": [], "error": None}


def test_the_roots_view_under_tp_is_not_a_silent_risk(pool4):
    """Under tp the root returns the LM head's gathered logits, a view that ``DTensor.to_local`` made in a custom
    autograd Function. FSDP2 warns about views it returns (an in-place op would drop its pre-backward hook); par3d
    silences that warning for the root under tp, because autograd itself refuses an in-place op on such a view."""
    plain = pool4.run(view_warning_job, in_place=False)[0]
    assert not any("returned a view tensor" in w for w in plain["warnings"]), plain["warnings"]
    in_place = pool4.run(view_warning_job, in_place=True, timeout=120)
    assert in_place[0]["error"] is not None and "is a view and is being modified inplace" in in_place[0]["error"]
