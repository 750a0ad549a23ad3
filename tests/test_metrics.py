"""What a user reads besides the loss: torchmetrics metrics, ``self.log`` values and throughput are the single-process
numbers at every layout."""

from __future__ import annotations

import functools
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torchmetrics import MaxMetric, MeanMetric, SumMetric
from torchmetrics.classification import MulticlassAccuracy

from examples.data import ShakespeareDataModule
from examples.gpt import GPTModule
from tests import background
from tests.gpt_runs import MODEL, SEED, ReferenceData, trainer_kwargs

# 16 validation windows of 32 bytes: divisible by every data-parallel size, so no sampler pads (a padded sample
# would be counted twice by any strategy, Lightning's own DDP included).
EVAL_DATA = dict(block_size=32, max_bytes=2051, val_fraction=0.25)
EVAL_BATCH = 8  # global


class MeteredGPT(GPTModule):
    """The example GPT plus the metrics of the issue that found the bug: a mean of per-sample losses and a sample
    count (updated in the loss, where the outputs are), a per-rank value logged with ``sync_dist``, and a value
    logged only inside the loss (under pp: only on the last stage)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.sample_loss = MeanMetric()
        self.samples = SumMetric()

    def loss_fn(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = super().loss_fn(logits, targets)
        if not self.training:
            per_sample = torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets, reduction="none").mean(1)
            self.sample_loss.update(per_sample)
            self.samples.update(targets.shape[0])
            self.log("loss_inside_loss_fn", loss, sync_dist=True)  # under pp: logged on the last stage alone
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().validation_step(batch, batch_idx)
        self.log("val_sample_loss", self.sample_loss)
        self.log("val_samples", self.samples)
        engine = getattr(self.trainer.strategy, "engine", None)
        dp_rank = engine.dp_rank if engine is not None else 0
        self.log("dp_rank_mean", float(dp_rank), sync_dist=True)
        return loss


METRICS = ("val_acc", "val_ppl", "val_tokens", "val_sample_loss", "val_samples", "val_loss", "loss_inside_loss_fn")


def validate(strategy: dict[str, Any] | None, devices: int = 1, world_sync: bool = False) -> dict[str, float]:
    """``trainer.validate`` of the seeded model; the logged metrics as every rank sees them (a dict per rank).
    ``world_sync`` is the sabotage: metrics synced over the whole world, as torchmetrics does by default."""
    from torchmetrics.utilities.distributed import gather_all_tensors

    from lightning_par3d.engine.placement import Placement

    original = Placement.metric_sync_fn
    if world_sync:
        Placement.metric_sync_fn = lambda self: lambda t, group=None: gather_all_tensors(t)  # type: ignore
    try:
        return _validate(strategy, devices)
    finally:
        Placement.metric_sync_fn = original  # type: ignore[method-assign]


def _validate(strategy: dict[str, Any] | None, devices: int) -> dict[str, float]:
    from lightning_par3d import Par3DStrategy

    L.seed_everything(SEED, verbose=False)
    dp = 1
    kwargs = trainer_kwargs(limit_val_batches=None)
    if strategy is None:
        trainer = L.Trainer(devices=1, **kwargs)
    else:
        par3d = Par3DStrategy(timeout_s=120, **strategy)
        trainer = L.Trainer(devices=devices, strategy=par3d, **kwargs)
        dp = par3d.layout.dp
    module = MeteredGPT(**MODEL)
    data = ShakespeareDataModule(batch_size=EVAL_BATCH // dp, **EVAL_DATA)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # par3d's own filters go in front of this one
        trainer.validate(module, data, verbose=False)
    assert len(data.val_set) == 16
    logged = {k: float(v) for k, v in trainer.callback_metrics.items()}
    # A stage without outputs computes what the last stage gathered: torchmetrics' warning is wrong there.
    logged["compute_before_update_warnings"] = sum("before the ``update``" in str(w.message) for w in caught)
    return logged


@functools.cache
def reference() -> dict[str, float]:
    return validate(None)


def assert_metrics_match(got: dict[str, float], ref: dict[str, float]) -> None:
    for name in ("val_tokens", "val_samples"):
        assert got[name] == ref[name], (name, got[name], ref[name])
    for name in ("val_acc", "val_ppl", "val_sample_loss", "val_loss", "loss_inside_loss_fn"):
        assert got[name] == pytest.approx(ref[name], rel=1e-6, abs=0), (name, got[name], ref[name])


LAYOUTS = [
    pytest.param(dict(dp_shard=2, tp=2), 2, id="dp2xtp2"),
    pytest.param(dict(dp_replicate=2, dp_shard=2), 4, id="hsdp2x2"),
    pytest.param(dict(pp=2, tp=2), 1, id="pp2xtp2"),
    pytest.param(dict(pp=2, dp_shard=2), 2, id="pp2xdp2"),
]


@pytest.mark.parametrize(("strategy", "dp"), LAYOUTS)
def test_validation_metrics_equal_one_process(pool4, strategy, dp):
    per_rank = pool4.run(validate, strategy=strategy, devices=4)
    ref = reference()
    for got in per_rank:  # every rank reads the same numbers: ModelCheckpoint and EarlyStopping see them alike
        assert_metrics_match(got, ref)
        assert got["dp_rank_mean"] == pytest.approx((dp - 1) / 2)  # the mean over the data-parallel ranks
        assert got["compute_before_update_warnings"] == 0
    assert ref["val_samples"] == 16 and ref["val_tokens"] == 16 * 32


def test_token_metrics_under_context_parallelism_equal_one_process(pool4):
    """cp2 × dp_shard2: each rank evaluates its slice of every row, and the metrics sync over the dp × cp ranks, so
    every token counts once: accuracy, perplexity, the token count and the losses are one process's. (A state counted
    per row, ``val_samples``, is counted by each cp rank: a known gap, docs/layouts.md#context-parallelism.)"""
    ref = reference()
    for got in pool4.run(validate, strategy=dict(cp=2, dp_shard=2), devices=4):
        assert got["val_tokens"] == ref["val_tokens"]
        for name in ("val_acc", "val_ppl", "val_loss", "loss_inside_loss_fn"):
            assert got[name] == pytest.approx(ref[name], rel=1e-6, abs=0), (name, got[name], ref[name])


def test_validation_metrics_in_full_3d(pool8):
    per_rank = pool8.run(validate, strategy=dict(pp=2, dp_shard=2, tp=2), devices=8)
    for got in per_rank:
        assert_metrics_match(got, reference())


def test_metrics_synced_over_the_world_would_be_caught(pool4):
    """The sabotage check: syncing over every rank (tp peers counted twice) fails the comparison."""
    got = pool4.run(validate, strategy=dict(dp_shard=2, tp=2), devices=4, world_sync=True)[0]
    with pytest.raises(AssertionError):
        assert_metrics_match(got, reference())
    assert got["val_samples"] == 2 * reference()["val_samples"]


def metric_states_job(where: str, init: str) -> dict[str, Any]:
    """Builds metrics in the module's constructor or in the build context (as configure_model would), then
    parallelizes the module, and reads the states."""
    from lightning_par3d import Par3DConfig, Par3DEngine

    class Holder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 4)
            if where == "init":
                self.build_metrics()

        def build_metrics(self) -> None:
            self.total = SumMetric()
            self.peak = MaxMetric()
            self.mean = MeanMetric()
            self.acc = MulticlassAccuracy(num_classes=3, average="micro")

    engine = Par3DEngine(Par3DConfig(dp_shard=2, init=init, timeout_s=120))
    engine.setup(torch.device("cpu"))
    torch.manual_seed(0)
    holder = Holder()
    with engine.init_context():
        if where == "configure_model":
            holder.build_metrics()
        holder.layer = torch.nn.Linear(4, 4)
    engine.parallelize(holder)
    states = {
        "total": holder.total.sum_value.item(),
        "peak": holder.peak.max_value.item(),
        "mean": (holder.mean.mean_value.item(), holder.mean.weight.item()),
        "acc": holder.acc.tp.tolist() + holder.acc.fn.tolist(),
    }
    holder.total.update(torch.tensor(3.0))
    holder.acc.update(torch.tensor([0, 1]), torch.tensor([0, 2]))
    states["after"] = (holder.total.compute().item(), holder.acc.compute().item())  # synced over dp=2
    return states


@pytest.mark.parametrize("init", ["rank0", "meta"])
@pytest.mark.parametrize("where", ["init", "configure_model"])
def test_metric_states_survive_the_build(pool2, where, init):
    for states in pool2.run(metric_states_job, where=where, init=init):
        assert states["total"] == 0.0
        assert states["peak"] == float("-inf")
        assert states["mean"] == (0.0, 0.0)
        assert states["acc"] == [0, 0]
        assert states["after"] == (6.0, 0.5)  # two ranks: 3 + 3, and 2 of 4 predictions right


def fit_monitoring_val_acc(strategy: dict[str, Any] | None, ckpt_dir: str, devices: int = 1) -> dict[str, Any]:
    """Three epochs of two steps, validating after each, with ``ModelCheckpoint(monitor="val_acc")``."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_par3d import Par3DStrategy

    L.seed_everything(SEED, verbose=False)
    checkpoint = ModelCheckpoint(dirpath=ckpt_dir, monitor="val_acc", mode="max", save_top_k=1)
    kwargs = trainer_kwargs(
        max_steps=-1, max_epochs=3, limit_train_batches=2, limit_val_batches=None, enable_checkpointing=True
    )
    dp = 1
    if strategy is None:
        trainer = L.Trainer(devices=1, callbacks=[checkpoint], **kwargs)
    else:
        par3d = Par3DStrategy(timeout_s=120, **strategy)
        trainer = L.Trainer(devices=devices, strategy=par3d, callbacks=[checkpoint], **kwargs)
        dp = par3d.layout.dp
    # Lightning shuffles with a seeded DistributedSampler under par3d; the reference reads the same order.
    data_class = ReferenceData if strategy is None else ShakespeareDataModule
    data = data_class(batch_size=EVAL_BATCH // dp, **EVAL_DATA)
    trainer.fit(MeteredGPT(**{**MODEL, "lr": 1e-2}), data)
    return {"best": checkpoint.best_model_path.rsplit("/", 1)[-1], "score": float(checkpoint.best_model_score)}


def test_model_checkpoint_monitoring_val_acc_picks_the_single_process_epoch(pool4, tmp_path):
    got = pool4.run(fit_monitoring_val_acc, strategy=dict(pp=2, tp=2), ckpt_dir=str(tmp_path / "par3d"), devices=4)
    ref = fit_monitoring_val_acc(None, str(tmp_path / "one"))
    for rank in got:
        assert rank["best"] == ref["best"]
        assert rank["score"] == pytest.approx(ref["score"], rel=1e-4)


class _Recorder(L.pytorch.loggers.Logger):
    """A logger that keeps what it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.metrics: list[dict[str, float]] = []

    @property
    def name(self) -> str:
        return "recorder"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.metrics.append(dict(metrics))

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass


class _OneSecondBatches(L.Callback):
    """The clock Lightning's ``ThroughputMonitor`` reads (its module's ``time``), made to advance exactly one second
    per training batch: the rates it logs are then counts, which the test checks exactly, not against another
    clock of a loaded machine."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def on_train_batch_start(self, *args: Any) -> None:
        self.now += 1.0


def throughput_job(steps: int = 8, window: int = 4) -> dict[str, Any]:
    from lightning.pytorch.callbacks import throughput_monitor

    from lightning_par3d import Par3DStrategy
    from lightning_par3d.callbacks import ThroughputMonitor

    L.seed_everything(SEED, verbose=False)
    recorder, clock = _Recorder(), _OneSecondBatches()
    monitor = ThroughputMonitor(
        batch_size_fn=lambda batch: batch[0].shape[0], window_size=window, peak_flops_per_device=1e12
    )
    par3d = Par3DStrategy(dp_shard=2, tp=2, timeout_s=120)
    kwargs = trainer_kwargs(max_steps=steps, log_every_n_steps=1)
    kwargs["logger"] = recorder
    trainer = L.Trainer(devices=4, strategy=par3d, callbacks=[clock, monitor], **kwargs)
    module = GPTModule(**MODEL)
    module.flops_per_batch = 1e9  # the whole model's FLOPs on one rank's batch, as measure_flops gives them
    real_time, throughput_monitor.time = throughput_monitor.time, clock  # type: ignore[assignment]
    try:
        trainer.fit(module, ShakespeareDataModule(batch_size=EVAL_BATCH // 2, **EVAL_DATA))
    finally:
        throughput_monitor.time = real_time
    if not trainer.is_global_zero:  # the monitor computes on rank 0
        return {}
    last = [m for m in recorder.metrics if "train/samples_per_sec" in m][-1]
    return {"metrics": last}


def test_throughput_counts_each_sample_once(pool4):
    """At dp2 × tp2, one second per batch (the monitor's clock, see ``_OneSecondBatches``): the global batch each
    second, every sample once (Lightning's own monitor would count each twice, tp × dp ranks)."""
    metrics = pool4.run(throughput_job)[0]["metrics"]
    assert metrics["train/samples_per_sec"] == pytest.approx(EVAL_BATCH, rel=1e-9)
    assert metrics["train/batches_per_sec"] == pytest.approx(2, rel=1e-9)  # one batch per second per dp rank
    # The whole model's FLOPs per global batch: dp × flops_per_batch per step, over 4 devices for MFU.
    assert metrics["train/flops_per_sec"] == pytest.approx(2 * 1e9, rel=1e-9)
    assert metrics["train/device/mfu"] == pytest.approx(metrics["train/flops_per_sec"] / 4 / 1e12, rel=1e-6)


MEMORY_SCRIPT = """
import sys
sys.path.insert(0, {repo!r})
import lightning as L
from examples.data import ShakespeareDataModule
from examples.gpt import GPTModule
from lightning_par3d import Par3DStrategy
from lightning_par3d.callbacks import MemoryStats


class Lit(GPTModule):  # defined in the user's script: its class lives in __main__
    pass


trainer = L.Trainer(
    accelerator="cpu", devices=2, strategy=Par3DStrategy(pp=2, timeout_s=300), max_steps=2, logger=False,
    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    limit_val_batches=0, default_root_dir={root!r}, callbacks=[MemoryStats()],
)
trainer.fit(Lit(block_size=32, n_layer=2, n_head=4, n_embd=32), ShakespeareDataModule(block_size=32, batch_size=4,
            max_bytes=4000))
"""


def _run_memory_script(folder: Path) -> subprocess.CompletedProcess:
    script = folder / "train_here.py"
    script.write_text(MEMORY_SCRIPT.format(repo=str(Path(__file__).parents[1]), root=str(folder)))
    return background.run([sys.executable, str(script)], timeout=600, cwd=folder)


memory_script = background.fixture("memory_script", _run_memory_script)


def test_memory_stats_estimate_for_a_module_defined_in_the_script(memory_script):
    """The estimate column is filled for a LightningModule whose class is defined in the training script (run in
    the background: see ``tests/background.py``)."""
    run = memory_script
    assert run.returncode == 0, run.stderr[-3000:]
    output = run.stdout + run.stderr
    assert "par3d memory per rank" in output, output[-3000:]
    table = output[output.index("par3d memory per rank") :]
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| rank")]
    assert len(rows) == 2  # a pipeline of two stages: each built from the script's class
    for row in rows:
        estimate = row.strip("| ").split(" | ")[8]
        assert float(estimate) > 0, row
    assert "no comparison" not in output
    assert "estimate failed" not in output
