"""The memory estimator against what real runs hold: model state within 5 %, activations within 25 %, at layouts
with tensor and pipeline parallelism; its table; its command-line mode; and its errors."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch

from examples.gpt import GPTModule
from lightning_par3d import Par3DConfig
from lightning_par3d.memory.estimate import estimate_memory
from tests.gpt_runs import DATA, GLOBAL_BATCH, MODEL

DEEP = {**MODEL, "n_layer": 4}


class MemoryProbe(L.Callback):
    """Per rank: model state before the second optimizer step, and the peak bytes each training batch after the
    first saves for backward (forward and backward; the whole pipeline schedule under pp). The first is left out:
    on it torch's pipeline stages run one more forward and backward to infer shapes, and part of that graph stays
    alive afterwards, so each batch gets a fresh meter that sees only its own tensors."""

    def __init__(self) -> None:
        self.meter: Any = None
        self.activations = 0
        self.state: Any = None

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        from lightning_par3d.memory.meters import SavedTensorMeter

        self.meter = SavedTensorMeter().__enter__()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, idx: int) -> None:
        self.meter.__exit__(None, None, None)
        if idx > 0:
            self.activations = max(self.activations, self.meter.peak)

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: Any, optimizer: Any) -> None:
        from lightning_par3d.memory.meters import model_state_bytes

        if trainer.global_step == 1:
            self.state = model_state_bytes(pl_module, trainer.optimizers)


def measure_job(strategy: dict, devices: int, precision: str = "32-true") -> dict:
    from examples.data import ShakespeareDataModule
    from lightning_par3d import Par3DStrategy
    from tests.gpt_runs import trainer_kwargs

    L.seed_everything(0, verbose=False)
    probe = MemoryProbe()
    par3d = Par3DStrategy(timeout_s=120, **strategy)
    kwargs = trainer_kwargs(max_steps=3, precision=precision)
    trainer = L.Trainer(devices=devices, strategy=par3d, callbacks=[probe], **kwargs)
    data = ShakespeareDataModule(batch_size=GLOBAL_BATCH // par3d.layout.dp, **DATA)
    trainer.fit(GPTModule(**DEEP), data)
    return {
        "state": probe.state,
        "activations": probe.activations,
        "pp_rank": par3d.mesh.coords(trainer.global_rank).pp,
    }


LAYOUTS = [
    pytest.param(dict(dp_shard=2, tp=2), 4, id="zero3-dp2xtp2"),
    pytest.param(dict(dp_shard=2, tp=2, precision="bf16-mixed"), 4, id="zero3-dp2xtp2-bf16-mixed"),
    pytest.param(dict(pp=2, tp=2, precision="bf16-true"), 4, id="pp2xtp2-bf16-true"),
    pytest.param(dict(dp_shard=2, tp=2, zero_stage=1), 4, id="zero1-dp2xtp2"),
    pytest.param(dict(pp=2, tp=2, microbatches=4), 4, id="pp2xtp2-1f1b"),
    pytest.param(dict(pp=2, dp_shard=2, zero_stage=1, microbatches=2), 4, id="pp2xdp2-zero1"),
    pytest.param(dict(dp_shard=2, tp=2, activation_checkpointing="full"), 4, id="dp2xtp2-full-ac"),
    pytest.param(dict(dp_shard=2, tp=2, sequence_parallel=True), 4, id="dp2xtp2-sequence-parallel"),
    pytest.param(dict(pp=2, tp=2, sequence_parallel=True), 4, id="pp2xtp2-sequence-parallel"),
    pytest.param(dict(pp=2, tp=2, activation_checkpointing="op"), 4, id="pp2xtp2-op-ac"),
    pytest.param(dict(cp=2, dp_shard=2), 4, id="cp2xdp2"),
    pytest.param(dict(pp=2, cp=2, microbatches=4), 4, id="pp2xcp2"),
    pytest.param(dict(pp=2, pipeline_schedule="gpipe", microbatches=4), 2, id="pp2-gpipe"),
    pytest.param(
        dict(pp=2, pipeline_schedule="interleaved_1f1b", virtual_stages=2, microbatches=4), 2, id="pp2-interleaved"
    ),
]


@pytest.mark.parametrize(("strategy", "pool"), LAYOUTS, indirect=["pool"])
def test_estimate_matches_measurement(strategy, pool):
    devices = pool.world_size
    strategy = dict(strategy)
    precision = strategy.pop("precision", "32-true")
    measured = pool.run(measure_job, strategy=strategy, devices=devices, precision=precision)
    config = Par3DConfig(**strategy)
    dp = devices // (config.pp * config.tp * config.cp)
    batch = (GLOBAL_BATCH // dp, MODEL["block_size"])
    estimate = estimate_memory(GPTModule(**DEEP), config, devices, batch, precision=precision)
    for rank, got in enumerate(measured):
        row = estimate.rows[got["pp_rank"]]
        for kind in ("params", "grads", "optimizer"):
            want, have = getattr(row.state, kind), getattr(got["state"], kind)
            assert abs(want - have) <= 0.05 * have, f"rank {rank} {kind}: estimated {want}, measured {have}"
        want, have = row.activations, got["activations"]
        assert abs(want - have) <= 0.25 * have, f"rank {rank} activations: estimated {want}, measured {have}"


def test_checkpointing_and_microbatching_shrink_the_estimate():
    module, batch = GPTModule(**DEEP), (16, 32)
    plain = estimate_memory(module, Par3DConfig(), 2, batch).rows[0]
    full = estimate_memory(module, Par3DConfig(activation_checkpointing="full"), 2, batch).rows[0]
    assert full.activations < 0.5 * plain.activations
    gpipe = estimate_memory(module, Par3DConfig(pp=2, pipeline_schedule="gpipe", microbatches=8), 2, batch)
    one_f_one_b = estimate_memory(module, Par3DConfig(pp=2, microbatches=8), 2, batch)
    assert [r.in_flight for r in gpipe.rows] == [8, 8]
    assert [r.in_flight for r in one_f_one_b.rows] == [2, 1]  # 1F1B: pp − rank microbatches in flight


def test_estimate_table_reads_per_rank():
    estimate = estimate_memory(GPTModule(**DEEP), Par3DConfig(pp=2, tp=2, zero_stage=0), 4, (8, 32))
    text = str(estimate)
    assert text.startswith("par3d memory estimate: pp=2 × dp_replicate=1 × dp_shard=1 × tp=2, ZeRO-0, 32-true")
    assert (
        "| pp rank | stages | ranks | params | grads | optimizer | activations | in flight | recompute | total |"
        in text
    )
    assert "| 0 | 0 | 0,1 |" in text and "| 1 | 1 | 2,3 |" in text


def test_estimate_refuses_to_run_inside_a_process_group(pool2):
    got = pool2.run(_estimate_inside_a_run)
    assert all("must run before launch" in message for message in got)


def _estimate_inside_a_run() -> str:
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    try:
        estimate_memory(GPTModule(**DEEP), Par3DConfig(), 2, (8, 32))
    except RuntimeError as err:
        return str(err)
    return "no error"


def test_a_plain_model_with_a_loss_function():
    """A factory of an nn.Module and a loss: the same model state as the LightningModule's estimate."""
    import torch.nn.functional as F

    from examples.gpt import GPT, GPT_TP_PLAN, GPTConfig

    def loss(logits, targets):
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    config = {k: v for k, v in DEEP.items() if k not in ("lr", "eps")}
    layout = Par3DConfig(tp=2, tp_plan=GPT_TP_PLAN)
    plain = estimate_memory(lambda: GPT(GPTConfig(**config)), layout, 2, (8, 32), loss_fn=loss)
    module = estimate_memory(GPTModule(**DEEP), Par3DConfig(tp=2), 2, (8, 32))
    assert plain.rows[0].state == module.rows[0].state
    assert abs(plain.rows[0].activations - module.rows[0].activations) <= 0.01 * module.rows[0].activations


def test_estimator_errors_are_clear():
    with pytest.raises(ValueError, match=r"optimizer='lion' is not known\. Allowed: adam, adamw, sgd, sgd_momentum"):
        estimate_memory(GPTModule(**DEEP), Par3DConfig(), 2, (8, 32), optimizer="lion")
    with pytest.raises(ValueError, match="tp=2 but Linear declares no tensor-parallel plan"):
        estimate_memory(
            lambda: torch.nn.Linear(2, 2), Par3DConfig(tp=2), 2, (8, 2), loss_fn=torch.nn.functional.mse_loss
        )
    with pytest.raises(TypeError, match="estimate_memory needs loss_fn"):
        estimate_memory(lambda: torch.nn.Linear(2, 2), Par3DConfig(), 2, (8, 2))


def test_a_transformers_model_pipelines_in_the_estimate_as_in_a_run():
    """The estimator splits a transformers decoder as a run does (each stage runs its own part of the model's
    forward): the first stage holds the embedding's activations and more microbatches in flight, the last the
    logits."""
    from examples.hf_llama import CausalLMModule

    module = CausalLMModule(num_hidden_layers=2)
    batch = (torch.zeros(16, 64, dtype=torch.long), torch.zeros(16, 64, dtype=torch.long))
    estimate = estimate_memory(module, Par3DConfig(pp=2, dp_shard=2, tp=2, microbatches=4), 8, batch)
    first, last = estimate.rows
    assert first.ranks == (0, 1, 2, 3) and last.ranks == (4, 5, 6, 7)
    assert first.in_flight == 2 and last.in_flight == 1
    assert all(r.activations_per_microbatch[0] > 0 and r.state.total > 0 for r in estimate.rows)


def test_the_estimate_is_the_runs_own_build(monkeypatch):
    """The estimator builds each stage with the run's ``parallelize_part`` (its tensor-parallel share of the checked
    plan, its blocks as FSDP2 units), so a change to the build changes the estimate: without checkpointing in
    ``parallelize_part``, ``full`` estimates what ``none`` does."""
    from lightning_par3d import compose as build

    calls: list[tuple[str, int, int]] = []
    real = build.parallelize_part

    def spy(part, mesh, config, precision, fqn_styles, blocks, stage_blocks=None, **more):
        calls.append((type(part).__name__, len(fqn_styles), len(blocks)))
        return real(part, mesh, config, precision, fqn_styles, blocks, stage_blocks, **more)

    monkeypatch.setattr(build, "parallelize_part", spy)
    estimate_memory(GPTModule(**DEEP), Par3DConfig(pp=2, dp_shard=2, tp=2), 8, (8, 32))
    assert len(calls) == 2 and all(styles > 0 and blocks == 2 for _, styles, blocks in calls), calls
    calls.clear()
    estimate_memory(GPTModule(**DEEP), Par3DConfig(dp_shard=2), 2, (8, 32))
    assert calls == [("GPTModule", 0, 4)]  # whole: 4 blocks run fewer than its cuts to 2 and 3 would
    calls.clear()
    estimate_memory(GPTModule(**{**DEEP, "n_layer": 6}), Par3DConfig(dp_shard=2), 2, (8, 32))
    assert calls == [("GPTModule", 0, 2), ("GPTModule", 0, 3)]  # by its depth: cut to 2 and 3 of its 6 blocks

    config = Par3DConfig(dp_shard=2, activation_checkpointing="full")
    plain = estimate_memory(GPTModule(**DEEP), Par3DConfig(dp_shard=2), 2, (8, 32)).rows[0]
    assert estimate_memory(GPTModule(**DEEP), config, 2, (8, 32)).rows[0].activations < 0.5 * plain.activations
    monkeypatch.setattr(build, "apply_activation_checkpointing", lambda *args: 0)
    assert estimate_memory(GPTModule(**DEEP), config, 2, (8, 32)).rows[0].activations == plain.activations


def test_the_estimate_in_a_fresh_interpreter_is_the_same(new_interpreter):
    """What ``MemoryStats`` runs inside a training process: the estimate in a new interpreter (the module pickled,
    batch shapes on meta) equals the one computed here, for a class the new interpreter could not import by name
    (defined in the running script, ``__main__``, the usual place for a training script's module): it travels by
    value, as one defined in a function does. (A class of an importable module travels by name, the simpler case,
    which the ``MemoryStats`` tests run.)"""
    from lightning_par3d.memory.estimate_process import estimate_in_fresh_interpreter

    config, batch = Par3DConfig(dp_shard=2, tp=2), (torch.empty(8, 32, dtype=torch.long, device="meta"),) * 2
    expected = estimate_memory(GPTModule(**DEEP), config, 4, batch, precision="bf16-mixed").rows
    script_class = type("Script", (GPTModule,), {"__module__": "__main__"})  # a class of the running script
    fresh = estimate_in_fresh_interpreter(script_class(**DEEP), config, 4, batch, precision="bf16-mixed")
    assert fresh.rows == expected


def test_the_dry_run_and_the_plan_hold_what_the_run_of_the_demo_layout_measures(new_interpreter, pool8):
    """The demo's layout (pp=2 × dp_shard=2 × tp=2) trained on 8 ranks, against the dry run of its first rank of each
    pipeline stage (each alone in a process, over a fake process group) and the plan's row for it: the dry run holds
    the run's parameters, gradients and optimizer state byte for byte and its activations within 10 %; the plan's
    peak (model state plus activations) is within 10 % of the run's."""
    from lightning_par3d import dry_run, plan

    strategy = dict(pp=2, dp_shard=2, tp=2)
    measured = pool8.run(measure_job, strategy=strategy, devices=8)
    rank_batch, seq = GLOBAL_BATCH // 2, MODEL["block_size"]
    tokens = torch.randint(0, 256, (rank_batch, seq + 1), generator=torch.Generator().manual_seed(0))
    dry = dry_run(GPTModule(**DEEP), Par3DConfig(**strategy), 8, (tokens[:, :-1], tokens[:, 1:]))
    assert [r.rank for r in dry.ranks] == [0, 4]
    for ran in dry.ranks:
        got = measured[ran.rank]
        assert (ran.params, ran.grads, ran.optimizer) == (
            got["state"].params,
            got["state"].grads,
            got["state"].optimizer,
        )
        assert abs(ran.activations_peak - got["activations"]) <= 0.10 * got["activations"], (ran, got)
    run = dict(zero_stage=3, pipeline_schedule="1f1b", microbatches=4, activation_checkpointing="none")
    table = plan(GPTModule(**DEEP), 8, 8, "1GiB", global_batch=GLOBAL_BATCH, seq_len=seq, fixed={**strategy, **run})
    [row] = table.fitting
    for got in measured:
        planned = next(r for r in row.memory.rows if r.pp_rank == got["pp_rank"])
        run_peak = got["state"].total + got["activations"]
        assert abs(planned.total - run_peak) <= 0.10 * run_peak, (planned, got)


def test_checkpointing_a_stage_of_one_block_lowers_its_peak_as_the_estimator_says(pool4):
    """pp=4 over 4 blocks: each stage holds one block, which no container of repeated blocks would find. Full
    checkpointing lowers every stage's measured peak of saved activations (the middle stages keep nothing: their
    input is the received activation), and the estimate of each stage's peak is within 10 % of the measurement."""
    batch = (GLOBAL_BATCH, MODEL["block_size"])
    peaks = {}
    for mode in ("none", "full"):
        strategy = dict(pp=4, activation_checkpointing=mode)
        measured = pool4.run(measure_job, strategy=strategy, devices=4)
        estimate = estimate_memory(GPTModule(**DEEP), Par3DConfig(**strategy), 4, batch)
        for got in measured:
            want, have = estimate.rows[got["pp_rank"]].activations, got["activations"]
            assert abs(want - have) <= 0.1 * have, f"{mode}, stage {got['pp_rank']}: estimated {want}, measured {have}"
        peaks[mode] = [got["activations"] for got in sorted(measured, key=lambda got: got["pp_rank"])]
    assert all(full < 0.5 * none for full, none in zip(peaks["full"], peaks["none"], strict=True)), peaks


def test_the_planner_counts_the_recompute_of_single_block_stages():
    """The cost model's recompute for pp=4 over 4 blocks: each stage's one block is counted (full checkpointing adds
    its forward FLOPs to the backward; selective counts every other block of the whole model, not of the stage)."""
    from lightning_par3d.planning.cost import recomputed_blocks
    from lightning_par3d.planning.probe import probe_layout, stage_work

    works = stage_work(GPTModule(**DEEP), Par3DConfig(), probe_layout(4, 1), MODEL["block_size"])
    assert [len(w.block_forward_flops) for w in works] == [1, 1, 1, 1]
    assert all(flops > 0 for w in works for flops in w.block_forward_flops)
    assert [w.first_block for w in works] == [0, 1, 2, 3]
    selective = Par3DConfig(activation_checkpointing="selective", ac_every=2)
    assert [recomputed_blocks(selective, 1, w.first_block) for w in works] == [[0], [], [0], []]
    assert [recomputed_blocks(Par3DConfig(activation_checkpointing="full"), 1, w.first_block) for w in works] == [
        [0],
        [0],
        [0],
        [0],
    ]


@pytest.mark.parametrize("model", ["gpt", "llama", "qwen3_moe"])
def test_the_planners_probe_by_depth_is_the_whole_stages_probe(model):
    """The planner probes a pipelined model's stages by role and depth (one and two blocks, shared by every split)
    and extends them to each stage's blocks: field by field, tensor-parallel collectives in their order included,
    what probing each whole stage gives, at uneven splits and several stages per rank."""
    from examples.hf_llama import CausalLMModule
    from lightning_par3d.planning.probe import probe_layout, stage_work

    if model == "gpt":
        module = GPTModule(**{**MODEL, "n_layer": 7})
    else:  # the model's own tp plan (for experts too: each block's entries renamed per block)
        from tests.test_moe import MOE

        module = CausalLMModule(num_hidden_layers=7, **MOE.get(model, {}))
    by_depth: dict = {}
    for pp, per_rank in ((2, 1), (3, 1), (2, 2), (7, 1)):
        layout = probe_layout(pp, per_rank)
        whole = stage_work(module, Par3DConfig(), layout, MODEL["block_size"])
        assert stage_work(module, Par3DConfig(), layout, MODEL["block_size"], by_depth=by_depth) == whole, layout
    assert sorted(by_depth) == [(False, False, 1), (False, False, 2), (False, True, 1), (False, True, 2),
                                (True, False, 1), (True, False, 2)]  # fmt: skip


class _UncopyableWhenBuilt(GPTModule):
    """Holds, once configured, something ``copy.deepcopy`` refuses (a generator)."""

    def configure_model(self) -> None:
        super().configure_model()
        self.pending = (i for i in range(1))


@pytest.mark.parametrize("layers", [4, 8])  # measured whole, and by depth (cut copies)
def test_a_model_that_refuses_a_deep_copy_is_estimated_from_fresh_builds(layers):
    """The estimator copies the model's one build for each measure; a model that cannot be deep-copied once built is
    built anew for each instead, to the same figures."""
    args = {**MODEL, "n_layer": layers}
    config = Par3DConfig(dp_shard=2, activation_checkpointing="full")
    expected = estimate_memory(GPTModule(**args), config, 2, (8, 32))
    assert estimate_memory(_UncopyableWhenBuilt(**args), config, 2, (8, 32)) == expected


def test_the_in_place_move_skip_is_the_building_threads_only():
    """While the estimator builds a model, a ``.to()`` that changes nothing leaves the module as it is, in that
    thread only: a user's other threads move modules as torch does, and ``nn.Module.to`` is torch's own after."""
    import threading

    from lightning_par3d.utils.torch_private import moves_in_place_skipped

    torchs_own = torch.nn.Module.to
    layer = torch.nn.Linear(2, 2)
    applied: list[str] = []
    original_apply = layer._apply

    def counted(*args: object, **kwargs: object) -> object:
        applied.append(threading.current_thread().name)
        return original_apply(*args, **kwargs)  # type: ignore[arg-type]

    layer._apply = counted  # type: ignore[method-assign]
    with moves_in_place_skipped():
        assert layer.to("cpu") is layer
        user = threading.Thread(target=lambda: layer.to("cpu"), name="a user's thread")
        user.start()
        user.join()
    assert applied == ["a user's thread"]
    assert torch.nn.Module.to is torchs_own


def test_a_batch_smaller_than_the_microbatches_is_refused_by_name_before_anything_is_built():
    """It used to fail inside the probe, with ``cannot reshape tensor of 0 elements``."""
    with pytest.raises(ValueError, match=r"batch of 1 sample\(s\) does not split into microbatches=4 equal .*"
                                         r"\(a multiple of 4.* or use microbatches=1 or fewer"):  # fmt: skip
        estimate_memory(GPTModule(**MODEL), Par3DConfig(pp=2, microbatches=4), 2, (1, MODEL["block_size"]))
    with pytest.raises(
        ValueError, match=r"batch of 6 sample\(s\) does not split into microbatches=4 .* microbatches=3"
    ):
        estimate_memory(GPTModule(**MODEL), Par3DConfig(pp=2, microbatches=4), 2, (6, MODEL["block_size"]))


@pytest.mark.parametrize(
    "module, config, precision",
    [
        ("llama", dict(pp=2, tp=2, dp_shard=2, microbatches=4), "32-true"),
        ("llama", dict(tp=2, dp_shard=4), "bf16-mixed"),  # no pipeline: the whole model, by its depth
        ("llama", dict(tp=2, dp_shard=2, dp_replicate=2, activation_checkpointing="full"), "32-true"),
        ("llama-lora", dict(tp=2, dp_shard=4), "32-true"),
        ("gpt", dict(dp_shard=8, zero_stage=2), "32-true"),
        ("gpt", dict(tp=2, dp_shard=4, sequence_parallel=True, activation_checkpointing="op"), "bf16-true"),
        ("llama", dict(pp=2, dp_shard=4, activation_checkpointing="full", microbatches=4), "bf16-mixed"),
        ("llama", dict(pp=2, tp=2, dp_shard=2, activation_checkpointing="op", microbatches=4), "32-true"),
        ("llama", dict(pp=2, tp=2, dp_shard=2, sequence_parallel=True, microbatches=4), "32-true"),
        ("llama-lora", dict(pp=2, tp=2, dp_shard=2, microbatches=4), "bf16-mixed"),
        ("gpt", dict(pp=2, dp_shard=2, tp=2, zero_stage=1, microbatches=4), "32-true"),
        (
            "gpt",
            dict(pp=2, dp_shard=4, pipeline_schedule="interleaved_1f1b", virtual_stages=2, microbatches=4),
            "bf16-mixed",
        ),
    ],
)
def test_stages_measured_by_their_depth_are_the_whole_stages_measure(module, config, precision, monkeypatch):
    """A stage of alike blocks is measured as a stage of one and of two blocks and extended to its depth: the
    estimate is the one that measures every stage whole (forced by calling every model's blocks unalike), field by
    field, first, middle and last stages alike. 10 blocks: stages of 5, or of 3 and 2 under the interleaved
    schedule; without a pipeline, the whole model is one stage of 10 blocks."""
    from torch._subclasses.fake_tensor import FakeTensor

    from examples.hf_llama import CausalLMModule
    from lightning_par3d.memory import stage_measure

    lora = dict(r=4, target_modules=["q_proj", "v_proj"])  # a frozen base, trainable adapters in every block
    build = {
        "llama": lambda: CausalLMModule(num_hidden_layers=10),
        "llama-lora": lambda: CausalLMModule(num_hidden_layers=10, lora=lora),
        "gpt": lambda: GPTModule(**{**MODEL, "n_layer": 10}),
    }
    extended: list[int] = []
    deeper = stage_measure.StageMeasure.deeper
    monkeypatch.setattr(
        stage_measure.StageMeasure,
        "deeper",
        lambda self, more, blocks, measured=1: extended.append(blocks) or deeper(self, more, blocks, measured),
    )
    built_kinds: set[type] = set()
    real_build = stage_measure._build

    def build_seen(*args: Any) -> Any:
        root = real_build(*args)
        built_kinds.update(type(p) for p in root.parameters())
        return root

    monkeypatch.setattr(stage_measure, "_build", build_seen)
    by_depth = estimate_memory(build[module](), Par3DConfig(**config), 8, (8, 32), precision=precision)
    assert extended and min(extended) >= 3
    assert built_kinds == {FakeTensor}  # never a real model: a real-sized one would not fit
    extended.clear()
    monkeypatch.setattr(stage_measure._OneBuild, "alike", lambda self, trunk, blocks: False)
    whole = estimate_memory(build[module](), Par3DConfig(**config), 8, (8, 32), precision=precision)
    assert extended == []
    assert by_depth == whole


def test_blocks_that_differ_are_measured_whole():
    """A Qwen2 whose last layers use a sliding window has blocks of two kinds: their signatures differ (its layer
    index aside), so its stages are measured whole; a Llama's 4 layers are alike."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from lightning_par3d.memory.stage_measure import block_signature

    small = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, vocab_size=100)
    with torch.device("meta"):
        qwen = Qwen2ForCausalLM(
            Qwen2Config(**small, num_key_value_heads=2, use_sliding_window=True, sliding_window=16, max_window_layers=2)
        )
        llama = LlamaForCausalLM(LlamaConfig(**small, num_key_value_heads=2))
    assert len({block_signature(layer) for layer in qwen.model.layers}) == 2
    assert len({block_signature(layer) for layer in llama.model.layers}) == 1
