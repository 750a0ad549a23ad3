"""Train the bundled GPT with par3d, configured by Hydra (``conf/``).

    python examples/train.py experiment=demo                  # dp=2 × tp=2 × pp=2 on 8 CPU processes
    python examples/train.py strategy.tp=2 trainer.devices=2  # any Par3DConfig field from the command line
    python examples/train.py -m strategy.dp_shard=1,2 strategy.tp=2 trainer.devices=4 strategy.dp_replicate=2,1
    python examples/train.py experiment=demo mode=estimate    # each rank's memory, before launching anything
    python examples/train.py mode=plan trainer.devices=16     # every layout ranked for 16 devices (no launch)
    python examples/train.py experiment=demo mode=dryrun trainer.devices=64 strategy.dp_shard=8 strategy.tp=4
                                                              # one step of rank 0 and 32 of 64, here
    python examples/train.py experiment=demo mode=advise      # the report's top suggestion, predicted and measured

Lightning launches the other ranks itself (re-running this command); under torchrun or SLURM each rank runs it.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, so that `examples.*` targets import

import hydra
import lightning as L
from hydra.utils import instantiate
from omegaconf import DictConfig

import lightning_par3d  # noqa: F401  (registers "par3d")
from lightning_par3d import quiet_known_upstream_warnings
from lightning_par3d.integrations.hydra_schema import register_configs
from lightning_par3d.memory.estimate import MemoryEstimate, estimate_memory

register_configs()
quiet_known_upstream_warnings()  # Lightning's known noise (docs/api.md, "The console")


def build_trainer(cfg: DictConfig) -> L.Trainer:
    """The Trainer with the par3d strategy, callbacks and logger of ``cfg``."""
    callbacks = [instantiate(c) for c in (cfg.callbacks or {}).values()]
    logger = instantiate(cfg.logger) if cfg.logger else False
    strategy = instantiate(cfg.strategy, _convert_="all", **pretrained_init(cfg))
    return instantiate(cfg.trainer, strategy=strategy, callbacks=callbacks, logger=logger)


def pretrained_init(cfg: DictConfig) -> dict[str, Any]:
    """With ``model.pretrained_path`` (``model=hf_llama``), par3d reads the checkpoint's weights into each rank's
    shards: ``strategy.init=pretrained`` from that directory, and the saved LoRA adapters of
    ``model.adapter_path`` (``model=hf_llama_lora``) with them."""
    path = cfg.model.get("pretrained_path")
    if not path:
        return {}
    return {"init": "pretrained", "pretrained_path": path, "adapter_path": cfg.model.get("adapter_path")}


def train(cfg: DictConfig) -> dict[str, float]:
    """Fits the model and returns the final logged metrics."""
    L.seed_everything(cfg.seed, workers=True)
    trainer = build_trainer(cfg)
    model = instantiate(cfg.model)
    data = instantiate(cfg.data)
    trainer.fit(model, data, ckpt_path=cfg.ckpt_path)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    if trainer.is_global_zero:
        print("final metrics: " + ", ".join(f"{k}={v:.4f}" for k, v in sorted(metrics.items())))
    return metrics


def estimate(cfg: DictConfig) -> MemoryEstimate:
    """``mode=estimate``: each rank's memory for the configured model, layout, batch and precision, computed in
    this process (fake tensors, a fake process group) before any rank is launched."""
    strategy = instantiate(cfg.strategy, _convert_="all")
    world_size = cfg.trainer.devices * cfg.trainer.num_nodes
    batch = (cfg.data.batch_size, cfg.data.block_size)
    precision = str(cfg.trainer.get("precision", "32-true"))
    result = estimate_memory(instantiate(cfg.model), strategy.config, world_size, batch, precision=precision)
    print(result)
    return result


def plan_layouts(cfg: DictConfig) -> Any:
    """``mode=plan``: every layout of the model on ``trainer.devices × trainer.num_nodes`` ranks, ranked by
    :func:`lightning_par3d.plan` for the machine ``plan.machine`` (a profile name, or ``calibrate`` to measure this
    one), without launching anything. The global batch is the configured run's (``data.batch_size`` per
    data-parallel rank of the configured layout); strategy sizes set away from their defaults are kept fixed."""
    from lightning_par3d.config import changed_settings
    from lightning_par3d.planning import calibrate, plan
    from lightning_par3d.planning.candidates import FIXED_KEYS
    from lightning_par3d.tools.plan import print_plan

    strategy = instantiate(cfg.strategy, _convert_="all")
    world_size = cfg.trainer.devices * cfg.trainer.num_nodes
    layout = strategy.engine.resolve(world_size)
    settings = {name: getattr(strategy.config, name) for name in FIXED_KEYS if hasattr(strategy.config, name)}
    fixed = {name: settings[name] for name in changed_settings(settings)}
    machine: Any = cfg.plan.machine
    if machine == "calibrate":
        machine = calibrate(min(max(world_size, 2), 8))
    table = plan(
        instantiate(cfg.model),
        world_size,
        cfg.trainer.devices,
        cfg.plan.device_memory,
        global_batch=cfg.data.batch_size * layout.dp,
        seq_len=cfg.data.block_size,
        precision=str(cfg.trainer.get("precision", "32-true")),
        machine=machine,
        fixed=fixed,
    )
    print_plan(table, top=cfg.plan.top, plot_to=cfg.plan.plot)  # as `par3d plan` prints it
    return table


def dry_run_ranks(cfg: DictConfig) -> Any:
    """``mode=dryrun``: one training step of chosen ranks (``dryrun.ranks``; default the first rank of every
    pipeline stage) of the configured layout on ``trainer.devices × trainer.num_nodes`` ranks, each in a process
    of its own here, over torch's fake process group, on a real batch of the data (:func:`lightning_par3d.dry_run`).
    """
    from lightning_par3d.tools.dry_run import dry_run

    strategy = instantiate(cfg.strategy, _convert_="all", **pretrained_init(cfg))
    data = instantiate(cfg.data)
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    world_size = cfg.trainer.devices * cfg.trainer.num_nodes
    ranks = list(cfg.dryrun.ranks) if cfg.dryrun.ranks is not None else None
    precision = str(cfg.trainer.get("precision", "32-true"))
    result = dry_run(instantiate(cfg.model), strategy.config, world_size, batch, ranks=ranks, precision=precision)
    print(result)
    return result


def _from_rank_zero(value: Any) -> Any:
    """Rank 0's ``value`` on every rank (after a fit the job's process group is still there)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def advise_and_verify(cfg: DictConfig) -> dict[str, Any]:
    """``mode=advise``: a short measured run of the configured job (``advise.steps`` steps, the bottleneck report
    sampling ``advise.sampled`` of them after ``advise.skip_first``), then, in the same processes, the same short
    run with the report's top suggestion (or ``advise.change``, a change the report weighs, by its description),
    and (``advise.recheck``) the configured run once more, whose difference from the first is the noise of a pair
    of runs; prints the change's predicted step beside the measured ones.
    """
    from omegaconf import OmegaConf

    from lightning_par3d.callbacks import BottleneckReport

    wanted = cfg.advise.get("change")
    weighed = weighed_changes(cfg) if wanted is not None else None
    if weighed is not None and wanted not in weighed:
        raise ValueError(
            f"advise.change={wanted!r} is not a change the bottleneck report weighs for this job. It weighs: "
            f"{', '.join(map(repr, weighed))}. Give one of them, quoted for Hydra and the shell "
            "('advise.change=\"microbatches=2\"'), or leave advise.change unset to check the top suggestion."
        )

    def measured_run(run_cfg: Any, advise: bool) -> tuple[BottleneckReport, float]:
        short = {"max_steps": cfg.advise.steps, "val_check_interval": None, "limit_val_batches": 0,
                 "enable_model_summary": False, "logger": False}  # fmt: skip
        L.seed_everything(run_cfg.seed, workers=True)
        strategy = instantiate(run_cfg.strategy, _convert_="all", **pretrained_init(run_cfg))
        report = BottleneckReport(skip_first=cfg.advise.skip_first, steps=cfg.advise.sampled, verbose=False,
                                  advise=advise)  # fmt: skip
        trainer = instantiate(run_cfg.trainer, strategy=strategy, callbacks=[report], **short)
        trainer.fit(instantiate(run_cfg.model), instantiate(run_cfg.data))
        steps = [s.step.cycle_us for s in report.summaries]
        return report, (sum(steps) / len(steps) / 1e6 if steps else 0.0)

    report, before = measured_run(cfg, advise=True)
    weighed = [a.change.description for a in report.advice]
    if wanted is None:
        top = next((a for a in report.advice if a.suggested), None)  # rank 0's: every rank follows it
    else:
        top = next((a for a in report.advice if a.change.description == wanted), None)
    noise = max(0.05, report.measured.noise) if report.measured is not None else 0.05
    top, advice_error, noise, weighed = _from_rank_zero((top, report.advice_error, noise, weighed))
    if wanted is not None and top is None and advice_error is None:
        raise ValueError(f"advise.change={wanted!r} is not a change the report weighs here. Weighed: {weighed}.")
    result: dict[str, Any] = {"measured_s": before, "suggestion": None}
    if advice_error is not None or top is None:
        if report.summaries:  # rank 0
            why = advice_error or "no change weighed is predicted to help beyond the run's noise"
            print(f"par3d advice: {why}; measured step {before * 1e3:,.1f} ms.")
        return result
    change = top.change
    if change.settings:
        overrides: dict[str, Any] = {"strategy": dict(change.settings)}
    else:  # outside the layout: the dataloader's workers
        overrides = {"data": {"num_workers": int(change.description.split("=")[1])}}
    _, after = measured_run(OmegaConf.merge(cfg, overrides), advise=False)
    again = measured_run(cfg, advise=False)[1] if cfg.advise.recheck else None
    result.update(suggestion=change.description, predicted_s=top.predicted_s, after_s=after, again_s=again)
    if report.summaries:
        assert top.predicted_s is not None
        lines = [
            f"par3d advice, checked: {change.description}",
            f"  measured step, as configured: {before * 1e3:,.1f} ms",
            f"  predicted with the change:    {top.predicted_s * 1e3:,.1f} ms ({top.predicted_s / before - 1:+.1%})",
            f"  measured with the change:     {after * 1e3:,.1f} ms ({after / before - 1:+.1%})",
        ]
        if again is not None:
            lines.append(
                f"  measured as configured again: {again * 1e3:,.1f} ms (pair noise {abs(again / before - 1):.1%})"
            )
        print("\n".join(lines))
    return result


def weighed_changes(cfg: DictConfig) -> list[str] | None:
    """The changes the bottleneck report weighs for the configured job, by description (what ``advise.change`` may
    name), from its layout and dataloader settings, before anything runs (None where the layout is chosen at launch
    or the devices are not a number: the report's own list decides then)."""
    from lightning_par3d import resolve_layout
    from lightning_par3d.planning.advice import candidate_changes

    devices, nodes = cfg.trainer.get("devices"), cfg.trainer.get("num_nodes") or 1
    strategy = instantiate(cfg.strategy, _convert_="all")
    if not isinstance(devices, int) or strategy.config.layout is not None:
        return None
    config = strategy.config
    layout = resolve_layout(config, devices * nodes)
    workers = cfg.data.get("num_workers")
    return [change.description for change in candidate_changes(config, layout, int(cfg.data.batch_size), workers)]


MODES: dict[str, Any] = {
    "train": lambda cfg: train(cfg).get("val_loss"),
    "estimate": lambda cfg: estimate(cfg).peak,
    "plan": lambda cfg: plan_layouts(cfg).best.step_s,
    "dryrun": lambda cfg: max(r.peak for r in dry_run_ranks(cfg).ranks),
    "advise": lambda cfg: advise_and_verify(cfg).get("after_s"),
}
"""``mode=`` → what it runs; each returns the number a Hydra sweeper would minimise."""


@hydra.main(version_base="1.3", config_path="../conf", config_name="train")
def main(cfg: DictConfig) -> Any:
    if cfg.mode not in MODES:
        raise ValueError(f"mode={cfg.mode!r} is not a mode. Allowed: {', '.join(map(repr, MODES))}.")
    return MODES[cfg.mode](cfg)


if __name__ == "__main__":
    main()
