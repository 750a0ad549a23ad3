"""Training runs of unmodified Hugging Face transformers causal LMs (``examples.hf_llama.CausalLMModule``), shared by
the single-process reference and the par3d jobs in the pool. Tiny configs, built here, never downloaded.

Same seed, same global batch, as in :mod:`tests.gpt_runs`: the reference reads the permutation a seeded
``DistributedSampler`` over one replica gives, ``GLOBAL_BATCH`` samples a step; each of par3d's dp ranks reads its
``GLOBAL_BATCH / dp`` of the same samples through the sampler Lightning injects.
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import Any

import lightning as L
import torch

from examples.data import ShakespeareDataModule
from examples.hf_llama import CausalLMModule
from tests.gpt_runs import DATA, GLOBAL_BATCH, SEED, LossRecorder, ReferenceData, full_state, trainer_kwargs

TINY = dict(
    vocab_size=256,
    block_size=32,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    lr=3e-3,
    eps=1e-6,
)
"""A tiny decoder: 4 query heads over 2 key/value heads (grouped-query attention), 2 layers."""

PACKED_PLAN = {
    "model.layers.*.self_attn.qkv_proj": "colwise_gather_output",
    "model.layers.*.self_attn.o_proj": "rowwise_split_input",
    "model.layers.*.mlp.gate_up_proj": "packed_colwise",
    "model.layers.*.mlp.down_proj": "rowwise",
    "lm_head": "colwise_gather_output",
}
"""A Phi-3 plan that splits the fused ``gate_up_proj`` per component (rank r holds [gate_r; up_r]), so that the MLP
runs on local shards with no gather between ``gate_up_proj`` and ``down_proj``."""


def module(model: dict[str, Any] | None = None) -> CausalLMModule:
    return CausalLMModule(**{**TINY, **(model or {})})


def run_reference(
    model: dict[str, Any] | None = None,
    max_steps: int = 5,
    data: dict[str, Any] | None = None,
    build_on_cpu: bool = False,
    **trainer: Any,
) -> dict[str, Any]:
    """One process, Lightning's default strategy (``trainer``: more Trainer arguments). ``build_on_cpu``: the model
    built on the CPU before ``fit``, as par3d's rank 0 builds it, where Lightning's single-device strategy would
    build it on its GPU (whose generator draws other weights from the same seed)."""
    L.seed_everything(SEED, verbose=False)
    recorder = LossRecorder()
    trainer = L.Trainer(devices=1, callbacks=[recorder], **trainer_kwargs(max_steps=max_steps, **trainer))
    lm = module(model)
    if build_on_cpu:
        with torch.device("cpu"):
            lm.configure_model()  # fit's own call then finds the model built
    trainer.fit(lm, ReferenceData(batch_size=GLOBAL_BATCH, **{**DATA, **(data or {})}))
    return {"losses": recorder.losses, "params": full_state(lm)}


def initial_state(model: dict[str, Any] | None = None) -> dict[str, torch.Tensor]:
    """The weights the runs start from: the module built on one process with the runs' seed, untrained."""
    L.seed_everything(SEED, verbose=False)
    lm = module(model)
    lm.configure_model()
    return {k: v.detach().clone() for k, v in lm.state_dict().items()}


class _BuildRecorder(CausalLMModule):
    """Records how many parameter bytes ``configure_model`` allocated for real (not on the meta device)."""

    real_bytes_built = -1

    def configure_model(self) -> None:
        if self.model is None:
            super().configure_model()
            self.real_bytes_built = sum(p.numel() * p.element_size() for p in self.parameters() if not p.is_meta)


class _OwnPlanRecorder(_BuildRecorder):
    """The module as a transformers user writes it with the model's own plan in hand: ``tp_plan`` returns
    ``dict(self.model.tp_plan)`` (keys relative to the transformers model: ``lm_head``, ``model.embed_tokens``,
    ``model.layers.*.self_attn.q_proj``, …)."""

    def tp_plan(self) -> dict[str, str]:  # type: ignore[override]
        assert self.model is not None
        return dict(self.model.tp_plan)


def run_par3d(
    strategy: dict[str, Any],
    devices: int,
    model: dict[str, Any] | None = None,
    max_steps: int = 5,
    export_to: str | None = None,
    checkpoint_to: str | None = None,
    resume_from: str | None = None,
    logits_of: torch.Tensor | None = None,
    data: dict[str, Any] | None = None,
    own_plan: bool = False,
    extra_callbacks: list[L.Callback] | None = None,
    rank_batch: int | None = None,
    **trainer_overrides: Any,
) -> dict[str, Any]:
    """One par3d run inside a pool worker. Each data-parallel rank reads ``GLOBAL_BATCH / dp`` samples a step, or
    ``rank_batch`` (``layout="auto"``, whose dp is chosen at launch); the result's ``layout`` is the one trained.
    ``own_plan``: the module's ``tp_plan`` hook returns the transformers model's own plan
    (``dict(self.model.tp_plan)``) instead of ``"auto"``. ``export_to``: then ``save_pretrained``
    there (``SavePretrained``).
    ``checkpoint_to``: then a par3d checkpoint there; ``resume_from``: resume from one. ``logits_of``: then the
    trained model's logits for these ids (``trainer.predict``: on every rank, under pp too). The result
    also tells how many parameter bytes the build allocated for real, how many each rank read from safetensors
    files, and how many it holds."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    from lightning_par3d import Par3DStrategy
    from lightning_par3d.callbacks import SavePretrained

    L.seed_everything(SEED, verbose=False)
    par3d = Par3DStrategy(timeout_s=120, **strategy)
    recorder = LossRecorder()
    callbacks: list[L.Callback] = [recorder] + ([SavePretrained(export_to)] if export_to else [])
    callbacks += extra_callbacks or []
    kwargs = trainer_kwargs(max_steps=max_steps, **trainer_overrides)
    trainer = L.Trainer(devices=devices, strategy=par3d, callbacks=callbacks, **kwargs)
    lm = (_OwnPlanRecorder if own_plan else _BuildRecorder)(**{**TINY, **(model or {})})
    batch_size = rank_batch if rank_batch is not None else GLOBAL_BATCH // par3d.layout.dp
    read = [0]
    original = HuggingFaceStorageReader._process_read_request

    def counting(self: Any, f: Any, req: Any, planner: Any) -> None:
        read[0] += math.prod(req.lengths) * planner.resolve_tensor(req).element_size()
        original(self, f, req, planner)

    HuggingFaceStorageReader._process_read_request = counting  # type: ignore[method-assign]
    try:
        datamodule = ShakespeareDataModule(batch_size=batch_size, **{**DATA, **(data or {})})
        trainer.fit(lm, datamodule, ckpt_path=resume_from)
    finally:
        HuggingFaceStorageReader._process_read_request = original  # type: ignore[method-assign]
    if checkpoint_to is not None:
        trainer.save_checkpoint(checkpoint_to)
    result: dict[str, Any] = {
        "layout": par3d.layout,
        "losses": recorder.losses,
        "params": full_state(lm),
        "real_bytes_built": lm.real_bytes_built,
        "bytes_read": read[0],
        "bytes_held": sum(_local(p).numel() * p.element_size() for p in lm.parameters()),
        "split_over_tp": sorted(name for name, p in lm.named_parameters() if _split_over_tp(p)),
        "split_over_ep": {name: _ep_split(p) for name, p in lm.named_parameters() if _ep_split(p)},
    }
    if logits_of is not None:
        result["logits"] = _predict(trainer, lm, logits_of)
    return result


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _ep_split(t: torch.Tensor) -> int:
    """Over how many ``ep`` ranks ``t`` is split along its first dimension (0: not over ep)."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(t, DTensor) or "ep" not in (t.device_mesh.mesh_dim_names or ()):
        return 0
    dim = t.device_mesh.mesh_dim_names.index("ep")
    return t.device_mesh.size(dim) if t.placements[dim] == Shard(0) else 0


def _split_over_tp(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor, Shard

    from lightning_par3d.utils.torch_private import strided_shard

    if not isinstance(t, DTensor):
        return False
    names = t.device_mesh.mesh_dim_names or ()
    split = (Shard, strided_shard())
    return any(name == "tp" and isinstance(p, split) for name, p in zip(names, t.placements, strict=True))


def _predict(trainer: L.Trainer, lm: CausalLMModule, ids: torch.Tensor) -> torch.Tensor | None:
    from torch.utils.data import DataLoader, TensorDataset

    loader = DataLoader(TensorDataset(ids, ids), batch_size=len(ids))
    outputs = trainer.predict(lm, loader)  # under pp: on every rank (broadcast from the last stage)
    return outputs[0].detach().cpu() if outputs and outputs[0] is not None else None


def save_tiny_pretrained(directory: str | Path, model: dict[str, Any] | None = None) -> Path:
    """A tiny random transformers model of ``module(model)``'s config, written with ``save_pretrained`` (sharded
    into several safetensors files, as real checkpoints are)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(SEED + 1)
    config = module(model).model_config()
    hf_model = AutoModelForCausalLM.from_config(config)
    hf_model.save_pretrained(directory, max_shard_size="20KB")
    return Path(directory)


def _built(config: Any, lora: dict[str, Any] | None) -> Any:
    """A transformers causal LM of ``config``, with ``get_peft_model`` LoRA adapters of ``lora`` if given."""
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_config(config)
    if lora is None:
        return hf_model
    from peft import LoraConfig, get_peft_model

    return get_peft_model(hf_model, LoraConfig(**lora))


def _trained(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def accelerate_hf_loop(
    strategy: dict[str, Any] | None, model: dict[str, Any] | None = None, steps: int = 5, lora: dict | None = None
) -> dict:
    """The README's Accelerate loop with a transformers model, unchanged: ``Par3DConfig(tp_plan="auto")``, the model
    built inside ``init_empty_weights()``, ``train_step`` with a loss that takes the model's output. ``strategy``
    None: the single-process reference (plain torch, same data and seed). ``lora``: the model gets peft's LoRA
    adapters, and the optimizer their parameters."""
    from tests.accelerate_runs import _data, _optimizer

    config = module(model).model_config()
    if strategy is None:
        torch.manual_seed(SEED)
        hf_model = _built(config, lora)
        optimizer = _optimizer(_trained(hf_model))
        losses = []
        for x, y in itertools.islice(_data(GLOBAL_BATCH), steps):
            loss = hf_loss(hf_model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        return {"losses": losses, "params": full_state(hf_model)}

    from accelerate.state import AcceleratorState, GradientState

    from lightning_par3d import Par3DConfig
    from lightning_par3d.accelerate import Par3DAccelerator

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    accelerator = Par3DAccelerator(par3d=Par3DConfig(tp_plan="auto", timeout_s=120, **strategy))
    torch.manual_seed(SEED)
    with accelerator.init_empty_weights():
        hf_model = _built(config, lora)
    optimizer = _optimizer(_trained(hf_model))
    loader = _data(GLOBAL_BATCH // accelerator.dp_size)
    hf_model, optimizer, loader = accelerator.prepare(hf_model, optimizer, loader)
    losses = []
    for x, y in itertools.islice(loader, steps):
        loss = accelerator.train_step(hf_model, x, y, hf_loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(accelerator.reduce(loss.detach(), "mean").item())
    return {"losses": losses, "params": full_state(accelerator.unwrap_model(hf_model))}


def fabric_hf_loop(
    strategy: dict[str, Any], model: dict[str, Any] | None = None, steps: int = 5, lora: dict | None = None
) -> dict:
    """:func:`accelerate_hf_loop`'s script under Lightning's Fabric with ``Par3DFabricStrategy``: the same model,
    seed, optimizer and batches (each data-parallel rank reads every ``dp``-th batch of the seeded loader)."""
    from lightning_par3d import Par3DFabricStrategy
    from tests.accelerate_runs import _data, _optimizer

    config = module(model).model_config()
    par3d = Par3DFabricStrategy(tp_plan="auto", timeout_s=120, **strategy)
    fabric = L.Fabric(accelerator="cpu", devices=4, strategy=par3d)
    fabric.launch()
    torch.manual_seed(SEED)
    with fabric.init_module(empty_init=True):
        hf_model = _built(config, lora)
    hf_model = fabric.setup_module(hf_model)
    optimizer = fabric.setup_optimizers(_optimizer(_trained(hf_model)))
    dp, dp_rank = fabric.strategy.engine.dp_size, fabric.strategy.engine.dp_rank
    losses = []
    for x, y in itertools.islice(_data(GLOBAL_BATCH // dp), dp_rank, steps * dp, dp):
        loss = fabric.strategy.train_step(hf_model, x, y, hf_loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(fabric.all_reduce(loss.detach(), reduce_op="mean").item())
    return {"losses": losses, "params": full_state(hf_model)}


def hf_loss(output: Any, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy of a transformers model's output (or, under pipelining, of the last stage's
    logits)."""
    from examples.hf_llama import logits_of

    logits = logits_of(output)
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def assert_resumes_both_ways(pool: Any, model: dict[str, Any], one: dict[str, Any], other: dict[str, Any],
                             folder: Path) -> None:  # fmt: skip
    """A checkpoint of 3 steps at layout ``one`` resumes at ``other``, and one saved at ``other`` resumes at ``one``,
    each on the single-process trajectory (one-batch epochs: no mid-epoch restart to worry about)."""
    from tests.conftest import assert_parity
    from tests.constants import ONE_BATCH_EPOCHS

    whole = run_reference(model, data=ONE_BATCH_EPOCHS)
    for before, after in ((one, other), (other, one)):
        path = str(folder / f"{len(before)}-{sorted(before)}.ckpt")
        run = dict(devices=pool.world_size, model=model, data=ONE_BATCH_EPOCHS)
        pool.run(run_par3d, strategy=before, max_steps=3, checkpoint_to=path, **run)
        resumed = pool.run(run_par3d, strategy=after, resume_from=path, **run)[0]
        assert_parity(resumed, {**whole, "losses": whole["losses"][-len(resumed["losses"]) :]})
