"""``torch.compile`` per block, in place, as torchtitan and Accelerate's regional compilation do it.

Each repeated block of the model (a transformer layer) is compiled with ``nn.Module.compile``: the block stays the
same object under the same name, and only its call goes through the compiled function. So

* parameter, state-dict and checkpoint names never gain ``_orig_mod.`` (a compiled run's checkpoint loads into an
  eager run and the other way round, at any layout);
* FSDP2's hooks, which ``fully_shard`` registers on the block *after* it is compiled, still run around it: they are
  written so that dynamo steps over them in eager training;
* identical blocks share one compiled graph (dynamo inlines ``nn.Module`` calls and treats their parameters as
  inputs), so compile time is that of one block's forward and backward, not of the whole model. A transformers
  model's training-time KV cache would give each layer a different graph; :func:`training_without_kv_cache` turns
  it off (``config.use_cache = False``, what transformers' own gradient checkpointing does in training).

:func:`~lightning_par3d.compose.parallelize_part` compiles after tensor parallelism and activation
checkpointing and before FSDP2 (torchtitan's order): the compiled graph then holds the block's DTensor ops and its
recompute, and FSDP2's all-gathers stay outside it.

What torch cannot compile is refused before any process starts: an unknown option (by the configuration's checks),
the inductor backend on CPU without a C++ compiler, or on a GPU without Triton (:func:`check_compile`).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from lightning_par3d.utils.model_changes import set_attribute
from lightning_par3d.utils.patterns import is_transformers_model, repeated_members
from lightning_par3d.utils.torch_private import triton_available


def compile_blocks(
    module: nn.Module, options: Mapping[str, Any] | None = None, blocks: list[nn.Module] | None = None
) -> int:
    """Compiles, in place, ``blocks`` (a pipeline stage's own, a single one included), by default every member of
    the model's containers of repeated blocks (see :func:`~lightning_par3d.utils.patterns.repeated_members`), with
    ``torch.compile(**options)``; returns how many."""
    if blocks is None:
        blocks = [block for sub in module.modules() for block in repeated_members(sub)]
    for block in blocks:
        compile_in_place(block, options)
    return len(blocks)


def training_without_kv_cache(module: nn.Module) -> list[str]:
    """Sets ``config.use_cache = False`` on every Hugging Face transformers model in ``module`` that has it on;
    returns their names. A KV cache serves generation, not training; in training it only gives each decoder layer
    a cache entry of its own, which a compiled layer guards on, so that every layer compiles again (16 layers: 16
    compilations, and dynamo falls back to eager after 8). ``generate()`` still caches: it asks for the cache
    itself."""
    changed = []
    for name, sub in module.named_modules():
        config: Any = getattr(sub, "config", None)
        if is_transformers_model(sub) and getattr(config, "use_cache", False):
            config.use_cache = False
            changed.append(name or type(sub).__name__)
    return changed


def compile_in_place(block: nn.Module, options: Mapping[str, Any] | None = None) -> None:
    """``block.compile(**options)``, recorded so that :func:`~lightning_par3d.utils.model_changes.undo` takes it
    back. The block keeps its class, its name and its parameters' names."""
    compiled = torch.compile(block._call_impl, **dict(options or {}))
    set_attribute(block, "_compiled_call_impl", _with_settled_inputs(compiled))


def _with_settled_inputs(compiled: Any) -> Any:
    """``compiled``, its tensor inputs waited for first where a collective still owes them.

    torch's tensor-parallel styles end their output's collective asynchronously, and ``to_local()`` hands the next
    module an ``AsyncCollectiveTensor``, which any eager op waits on. A block whose input comes straight from such a
    module (a transformers model's first layer, after a vocabulary-parallel ``embed_tokens``) would receive it as a
    graph input, and AOTAutograd (under inductor and ``aot_eager``) then routes its gradient past ``to_local``'s
    backward: the backward fails ("'Tensor' object has no attribute '_local_tensor'") or, at dp × tp, trains
    wrong. A ``clone`` outside the graph (one copy of the first block's input) gives the graph a plain tensor, with
    ``to_local``'s backward in its gradient's path."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    def settle(x: Any) -> Any:
        return x.clone() if isinstance(x, AsyncCollectiveTensor) else x

    def call(*args: Any, **kwargs: Any) -> Any:
        args = tuple(settle(a) for a in args)
        kwargs = {k: settle(v) for k, v in kwargs.items()}
        return compiled(*args, **kwargs)

    return call


def is_compiled(block: nn.Module) -> bool:
    """Whether ``block``'s calls go through ``torch.compile`` (``nn.Module.compile`` or :func:`compile_in_place`)."""
    return getattr(block, "_compiled_call_impl", None) is not None


def check_compile(options: Mapping[str, Any], device_type: str) -> None:
    """Raises ``ValueError`` if torch cannot compile with ``options`` on ``device_type`` here: the inductor backend
    (torch's default) needs a C++ compiler on CPU and Triton on CUDA. Called before any process is launched."""
    backend = options.get("backend", "inductor")
    if not isinstance(backend, str):  # a backend object (torch.compile'd by the user: its configured backend)
        backend = getattr(backend, "compiler_name", None)
    if backend != "inductor" or options.get("disable"):
        return
    if device_type == "cpu":
        compiler = os.environ.get("CXX") or next((c for c in ("c++", "g++", "clang++") if shutil.which(c)), None)
        if compiler is None or shutil.which(compiler) is None:
            raise ValueError(
                "compile=True with the inductor backend on CPU needs a C++ compiler, and none was found (CXX, c++, "
                "g++, clang++). Install one (e.g. the g++ package), set compile_options={'backend': 'aot_eager'} "
                "to trace without generating code, or set compile=False."
            )
    elif device_type == "cuda" and not triton_available():
        raise ValueError(
            "compile=True with the inductor backend on CUDA needs Triton, which is not installed or does not "
            "support this GPU. Install the triton that matches this torch, or set compile=False."
        )
