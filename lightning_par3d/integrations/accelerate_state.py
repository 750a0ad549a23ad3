"""``Par3DAccelerator``'s weights and checkpoints: Accelerate's own state (RNG, schedulers, samplers, registered
objects) as Accelerate saves it, and the model and optimizers as one sharded DCP checkpoint through the engine,
loadable at any layout; the whole model's weights on process 0; a transformers ``save_pretrained`` directory."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from torch import nn

from lightning_par3d.engine import Par3DEngine
from lightning_par3d.pipeline.trunk import PipelineHost
from lightning_par3d.utils.model_changes import restore_attribute


class Par3DStateCheckpoints(Accelerator):
    """Mixed into :class:`~lightning_par3d.integrations.accelerate.Par3DAccelerator` (which sets ``engine``)."""

    engine: Par3DEngine

    def unwrap_model(self, model: nn.Module, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True) -> Any:
        """The model the script built (out of DDP or the pipeline host)."""
        module = self.engine.module
        if isinstance(module, PipelineHost):
            module = module.trunk
        if not keep_fp32_wrapper:  # the class's own forward again, without the autocast wrapper prepare set
            restore_attribute(module, "forward")
        return module

    def get_state_dict(self, model: nn.Module, unwrap: bool = True) -> dict[str, torch.Tensor] | None:
        """The whole model's weights, unsharded and under their original names, on process 0 (None elsewhere)."""
        return self.engine.full_state_dict()

    def save_pretrained(self, directory: str | Path) -> Path:
        """Writes the prepared Hugging Face transformers model as a ``save_pretrained`` directory from any layout
        (weights gathered on process 0, which writes them). Use it instead of ``unwrap_model(model).save_pretrained``:
        under pipeline parallelism no process holds the whole model. Every process must call it."""
        return self.engine.save_pretrained(directory)

    def save_state(self, output_dir: str | None = None, safe_serialization: bool = True, **kwargs: Any) -> str:
        """Accelerate's state (schedulers, RNG, samplers, registered objects) as Accelerate saves it, and the model
        and optimizers as one sharded DCP checkpoint (``output_dir/par3d``), loadable at any layout."""
        models, optimizers = self._models, self._optimizers  # type: ignore[has-type]
        self._models, self._optimizers = [], []
        self.engine.wait_for_saves()  # Accelerate's total_limit may remove the folder a save still writes
        try:
            location = super().save_state(output_dir, safe_serialization, **kwargs)
        finally:
            self._models, self._optimizers = models, optimizers
        states = [self.engine.optimizer_state(optimizer) for optimizer in optimizers]
        # Accelerate saves and restores each process's random generators itself
        self.engine.save(Path(location) / "par3d", {"step": self.step}, states, streams=False)  # type: ignore[has-type]
        return location

    def end_training(self) -> None:
        """Waits for a save still written in the background, then Accelerate's end (which may destroy the process
        group the save uses)."""
        self.engine.wait_for_saves()
        super().end_training()

    def load_state(self, input_dir: str | None = None, load_kwargs: dict | None = None, **kwargs: Any) -> None:
        """The counterpart of :meth:`save_state`; the checkpoint may come from another layout."""
        models, optimizers = self._models, self._optimizers
        self._models, self._optimizers = [], []
        try:
            super().load_state(input_dir, load_kwargs, **kwargs)
        finally:
            self._models, self._optimizers = models, optimizers
        assert input_dir is not None
        metadata = self.engine.load(Path(input_dir) / "par3d", optimizers, streams=False)
        self.step = int(metadata.get("step", self.step))  # type: ignore[arg-type, has-type]
