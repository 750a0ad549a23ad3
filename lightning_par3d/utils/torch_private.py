"""The private torch APIs par3d still uses, each behind one function, with why and what would replace it.

Everywhere else the package calls torch's public API, with two kinds of exception that cannot move here:
``nn.Module``'s own ``_parameters`` / ``_buffers`` / ``_modules`` dictionaries (read and written as torch's own
module utilities do), and ``GlobalGradScaler`` overriding ``GradScaler._unscale_grads_`` (the one place a scaler
checks gradients for infs; see :func:`unscale_and_check_finite`). Each entry below is needed because torch 2.13 has
no public way to do the same thing; a torch upgrade that breaks one breaks it here, and its docstring names the
public API to move to. Imports are inside the functions, so that importing this module imports no more of torch.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


def fake_tensor_mode() -> Any:
    """``FakeTensorMode`` (tensors with shapes, dtypes and devices but no storage), for the memory estimator.

    Private module: ``torch._subclasses.fake_tensor``. No public constructor exists; ``torch.export`` and
    ``torch.compile`` create it internally."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


def is_fake(t: torch.Tensor) -> bool:
    """Whether ``t`` is a fake tensor (the memory estimator's simulated step), whose values cannot be read.

    Private module: ``torch._subclasses.fake_tensor.is_fake``; no public equivalent."""
    from torch._subclasses.fake_tensor import is_fake as fake

    return bool(fake(t))


def fake_mode_paused() -> Any:
    """A context in which no ``FakeTensorMode`` is active, while fake tensors stay fake (every op on them still
    dispatches to their own mode). The memory estimator builds the model under the fake mode, then parallelizes it
    in this context: a ``DeviceMesh`` (which FSDP2 builds for a parameter that is already a tp DTensor) computes its
    coordinates with ``nonzero()``, whose output shape depends on data, which the fake mode refuses.

    Private module: ``torch._subclasses.fake_tensor.unset_fake_temporarily``; no public equivalent."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    return unset_fake_temporarily()


def deepcopy_with_fake_tensors(obj: Any, memo: dict[int, Any] | None = None) -> Any:
    """``copy.deepcopy(obj, memo)`` for a module that holds fake tensors (the memory estimator's and the planner's
    models), where torch's own deep copy goes wrong twice:

    * a fake tensor is copied with its ``__dict__``, which holds its ``FakeTensorMode``: each copy made a new fake
      mode, a deep copy of its caches and the C++ objects they hold, whose later deallocation crashed the process
      (a segmentation fault, ``corrupted double-linked list``, ``pybind11_object_dealloc(): Tried to deallocate
      unregistered instance!`` inside ``copy.deepcopy``; 20 copies of one stage of a small Llama were enough). Each
      fake mode enters the memo as itself;
    * a real (or meta) tensor is copied through its storage, which an active fake mode refuses ("Attempted to set
      the storage of a tensor on device 'meta' to a storage on different device 'cpu'"): a metric's states. The
      module's tensors that are not fake are copied first with the fake mode paused.

    Private module: ``torch._subclasses.fake_tensor`` (see :func:`is_fake`); torch has no public deep copy of a
    fake model."""
    import copy

    memo = {} if memo is None else memo
    real = []
    for tensor in _held_tensors(obj, memo):
        if is_fake(tensor):
            mode = tensor.fake_mode  # type: ignore[attr-defined]
            memo[id(mode)] = mode
        else:
            real.append(tensor)
    with fake_mode_paused():
        for tensor in real:
            copy.deepcopy(tensor, memo)
    return copy.deepcopy(obj, memo)


def _held_tensors(obj: Any, memo: dict[int, Any]) -> list[torch.Tensor]:
    """The tensors ``obj`` (a module: each of its submodules not in ``memo``) holds as parameters, buffers or
    attributes, within dicts, lists, tuples and sets; each once."""
    found: dict[int, torch.Tensor] = {}
    seen: set[int] = set()
    stack: list[Any] = [obj]
    while stack:
        value = stack.pop()
        if id(value) in seen or id(value) in memo:
            continue
        seen.add(id(value))
        if isinstance(value, torch.Tensor):
            found[id(value)] = value
        elif isinstance(value, torch.nn.Module):
            stack.append(vars(value))
        elif isinstance(value, dict):
            stack.extend(value.values())
        elif isinstance(value, (list, tuple, set, frozenset)):
            stack.extend(value)
    return list(found.values())


_BUILDING = threading.local()
"""Whether this thread builds a model on fake tensors (:func:`moves_in_place_skipped`)."""
_TO_LOCK = threading.Lock()
_TO_USERS = [0]
_ORIGINAL_TO = torch.nn.Module.to


def _to_unless_in_place(self: torch.nn.Module, *args: Any, **kwargs: Any) -> torch.nn.Module:
    """``nn.Module.to``, except in a thread inside :func:`moves_in_place_skipped`, where a move that would change no
    tensor's device or dtype returns the module untouched."""
    if getattr(_BUILDING, "active", False):
        device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        tensors = [*self.parameters(), *self.buffers()]
        if all(
            (device is None or t.device == device) and (dtype is None or not t.is_floating_point() or t.dtype == dtype)
            for t in tensors
        ):
            return self
    return _ORIGINAL_TO(self, *args, **kwargs)


@contextlib.contextmanager
def moves_in_place_skipped() -> Iterator[None]:
    """While a model is built on fake tensors in this thread, ``module.to(...)`` returns the module untouched when
    it would change no tensor's device or dtype. torch converts a fake parameter by swapping it for a new one, which
    fails for a parameter something else still references ("_apply(): Couldn't swap Linear.weight"), even when the
    move is to where the parameter already is: ``peft`` moves each adapter it makes onto its base layer's device so.

    Scoped to this thread and this context: ``nn.Module.to`` is wrapped while any thread is inside (and put back
    after the last one leaves), and the wrapper behaves as torch's own in every other thread, so a user's threads
    see no change while the public ``estimate_memory`` runs.

    Private: ``torch._C._nn._parse_to`` (how ``Module.to`` reads its arguments; no public parser)."""
    with _TO_LOCK:
        _TO_USERS[0] += 1
        torch.nn.Module.to = _to_unless_in_place  # type: ignore[method-assign,assignment]
    _BUILDING.active = True
    try:
        yield
    finally:
        _BUILDING.active = False
        with _TO_LOCK:
            _TO_USERS[0] -= 1
            if _TO_USERS[0] == 0:
                torch.nn.Module.to = _ORIGINAL_TO  # type: ignore[method-assign]


def set_default_group_timeout(timeout: timedelta) -> None:
    """Gives the existing default process group (created by Lightning, Accelerate or the user) par3d's collective
    timeout. Public API sets it only when the group is created (``init_process_group(timeout=...)``).

    Private: ``torch.distributed.distributed_c10d._set_pg_timeout``."""
    dist.distributed_c10d._set_pg_timeout(timeout)


def default_store() -> Any:
    """The default process group's key-value store (par3d's step notes and failure records, and its timeout).
    torch exposes the store only to the code that creates the group.

    Private: ``torch.distributed.distributed_c10d._get_default_store``."""
    return dist.distributed_c10d._get_default_store()


def queue_end_of_backward(callback: Callable[[], None]) -> None:
    """Runs ``callback`` once the current backward pass ends (the ZeRO optimizer's last gradient buckets). Public
    replacement: none; FSDP2 and DDP's Python reducer use the same call.

    Private: ``torch.autograd.Variable._execution_engine.queue_callback``."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def in_backward() -> bool:
    """Whether this thread is running a backward pass (where non-reentrant activation checkpointing recomputes a
    layer's forward, hooks included). Public replacement: none (``torch.utils.checkpoint`` uses the same call).

    Private: ``torch._C._current_graph_task_id`` (-1 outside a backward)."""
    return bool(torch._C._current_graph_task_id() != -1)


def in_pipeline_metadata_inference() -> bool:
    """Whether the caller runs inside torch's pipeline metadata inference (``PipelineStage._forward_metadata_
    inference`` or ``_backward_...``, run once per schedule before its first microbatch, on tensors made from shapes
    only), found on the call stack. Public replacement: none (a flag on the stage would be one).

    Private: those methods' names (were they renamed, this would answer False)."""
    import sys

    frame: Any = sys._getframe(1)
    for _ in range(24):
        if frame is None:
            return False
        if frame.f_code.co_name.endswith("_metadata_inference"):
            return True
        frame = frame.f_back
    return False


def strided_shard() -> Any:
    """DTensor's ``_StridedShard`` placement class: a dimension cut in interleaved pieces (a packed projection
    under tensor parallelism, and the dp cut of a tp-sharded dim as FSDP2 lays it out). torch's public placements
    are ``Shard``, ``Replicate`` and ``Partial`` only.

    Private: ``torch.distributed.tensor.placement_types._StridedShard``."""
    from torch.distributed.tensor.placement_types import _StridedShard

    return _StridedShard


def all_to_all_with_autograd(
    x: torch.Tensor, output_split_sizes: list[int], input_split_sizes: list[int], group: Any
) -> torch.Tensor:
    """``all_to_all_single`` whose backward sends the gradients back the same way (expert parallelism's dispatch),
    its result waited for.

    Private: ``torch.distributed._functional_collectives.all_to_all_single``. torch 2.13 deprecates the public
    ``torch.distributed.nn.functional.all_to_all_single`` (it warns on every call) in favour of this one."""
    from torch.distributed._functional_collectives import all_to_all_single, wait_tensor

    return wait_tensor(all_to_all_single(x, output_split_sizes, input_split_sizes, group))


def all_gather_with_autograd(x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    """Every rank's ``x`` of ``group`` concatenated along ``dim`` in rank order, waited for; its backward
    reduce-scatters the gradient (context parallelism's gathered keys and values).

    Private: ``torch.distributed._functional_collectives.all_gather_single`` (differentiable since torch 2.12;
    torch has no public all-gather with autograd that is not deprecated)."""
    from torch.distributed._functional_collectives import all_gather_single, wait_tensor

    return wait_tensor(all_gather_single(x, dim, group))


def functional_collective_ops() -> Any:
    """The op namespace of torch's functional collectives (``all_reduce``, ``all_gather_into_tensor`` …), whose
    outputs ``op``-mode activation checkpointing saves. The ops are registered only under this name.

    Private: ``torch.ops._c10d_functional``."""
    return torch.ops._c10d_functional


def unscale_and_check_finite(grads: list[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor) -> None:
    """Multiplies ``grads`` by ``inv_scale`` in place and sets ``found_inf`` where one holds an inf or a NaN: what
    ``GradScaler`` does per device, here over each rank's local shards. Public replacement: none (``GradScaler``
    calls it from its own ``_unscale_grads_``, which par3d's ``GlobalGradScaler`` overrides, also private).

    Private: ``torch._amp_foreach_non_finite_check_and_unscale_``."""
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)


def schedule_stages(schedule: Any) -> list[Any]:
    """The ``PipelineStage`` objects a ``torch.distributed.pipelining`` schedule runs (the bottleneck report wraps
    their compute calls). Public replacement: keeping the list where the stages are made
    (``pipeline.runner.build_runner``), which then needs no torch internals.

    Private: ``_stages`` (multi-stage schedules) and ``_stage`` (single-stage ones)."""
    stages = getattr(schedule, "_stages", None)
    return list(stages) if stages else [schedule._stage]


def split_backward() -> tuple[Callable[..., Any], Callable[..., Any], Callable[..., Any]]:
    """torch's pipeline stage backward, whole and split in two: ``stage_backward``, ``stage_backward_input`` and
    ``stage_backward_weight``, as the zero-bubble schedules call them (the calibration times the split's own cost).

    Private module: ``torch.distributed.pipelining._backward``; the schedules call these themselves, and torch has
    no public way to run one stage's backward the way a schedule does."""
    from torch.distributed.pipelining._backward import stage_backward, stage_backward_input, stage_backward_weight

    return stage_backward, stage_backward_input, stage_backward_weight


def dtensor_local(t: Any) -> torch.Tensor:
    """A DTensor's own local tensor, the very storage FSDP2 and DCP use, with no autograd in between. The public
    ``DTensor.to_local()`` goes through an autograd function (a view with a ``grad_fn`` under grad mode), which
    in-place collectives on gradients and storage counts must not see.

    Private: ``DTensor._local_tensor``."""
    return t._local_tensor


def view_base(t: torch.Tensor) -> torch.Tensor | None:
    """The tensor ``t`` is a view of (None if it is not a view): a linear layer saves ``weight.t()``, which the
    activation meter must recognise as the parameter. Documented in torch's "Tensor Views" notes, but named
    privately.

    Private: ``Tensor._base``."""
    return t._base


def clear_sharding_propagation_cache() -> None:
    """Empties DTensor's cache of sharding decisions. It is keyed by mesh equality and holds the mesh a decision was
    made on, so a mesh of a later fake world (the planner simulates hundreds) that equals an earlier one would be
    handed the earlier, destroyed mesh. Private: ``torch.distributed.tensor.debug._clear_sharding_prop_cache``; no
    public equivalent."""
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()


def skip_pipeline_metadata_vote() -> None:
    """For the dry run's own process only (:mod:`lightning_par3d.tools.dry_run`, a fresh interpreter over the
    fake backend): torch 2.13's pipeline schedules decide between static and dynamic stage metadata by a vote passed
    from stage to stage over P2P (``_PipelineSchedule._warmup_p2p``), which the fake backend cannot carry (a receive
    leaves its buffer as it was, so every vote reads "dynamic" and the stages then wait for shapes no peer sends).
    This replaces the vote with each stage's own answer: static where it was given its inputs and outputs. Public
    replacement: none yet (an ``inference_mode=`` argument of ``PipelineStage`` would be one)."""
    from torch.distributed.pipelining import schedules
    from torch.distributed.pipelining._utils import InferenceMode

    def own_vote(self: Any, stages: list[Any], has_backward: bool, p2p_done: bool) -> None:
        for stage in stages:
            dynamic = InferenceMode.needs_dynamic(stage._user_meta, has_backward)
            stage._inference_mode = InferenceMode.DYNAMIC if dynamic else InferenceMode.STATIC

    schedules._PipelineSchedule._warmup_p2p = own_vote  # type: ignore[method-assign]


def triton_available() -> bool:
    """Whether inductor can generate GPU code here (Triton installed and supporting the device)."""
    from torch.utils._triton import has_triton

    return bool(has_triton())


def compile_options_of(compiled: Any) -> dict[str, Any]:
    """The ``torch.compile`` keywords a ``torch._dynamo.OptimizedModule`` (the result of ``torch.compile(module)``)
    was made with: its backend (the configured backend object torch built from ``backend``, ``mode`` and
    ``options``, which compiles alike when given as ``backend``), ``fullgraph`` and ``dynamic``. Raises
    ``ValueError`` where torch keeps them otherwise than in 2.13."""
    context = getattr(compiled, "dynamo_ctx", None)
    backend = getattr(getattr(context, "callback", None), "_torchdynamo_orig_backend", None)
    if context is None or backend is None:
        raise ValueError(
            "par3d could not read the torch.compile options of the compiled model (this torch keeps them elsewhere). "
            "Pass the uncompiled model and set compile=True (with compile_options) on the strategy instead."
        )
    while hasattr(backend, "_torchdynamo_orig_backend"):  # torch's debugging and frame-conversion wrappers
        backend = backend._torchdynamo_orig_backend
    return {"backend": backend, "fullgraph": bool(context.fullgraph), "dynamic": context._dynamic}


class _Fp32GroupedMMShapes(torch.utils._python_dispatch.TorchDispatchMode):
    """Gives ``aten._grouped_mm`` of fp32 fake or meta tensors its output, shaped as torch's meta kernel shapes it
    (``_create_grouped_mm_output_tensor``), in fp32 as the CPU kernel gives it."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.ops.aten._grouped_mm.default and _fp32_without_storage(args[:2]):
            a, b = args[:2]
            offs = args[2] if len(args) > 2 else kwargs.get("offs")
            if a.dim() == 2:
                shape = [offs.size(0), a.size(0), b.size(1)] if b.dim() == 2 else [a.size(0), b.size(-1)]
            else:
                shape = [a.size(1), b.size(1)] if b.dim() == 2 else [a.size(0), a.size(1), b.size(-1)]
            dtype = (args[4] if len(args) > 4 else kwargs.get("out_dtype")) or torch.float32
            return torch.empty(shape, dtype=dtype, device=a.device)
        return func(*args, **kwargs)


def _fp32_without_storage(tensors: Any) -> bool:
    return all(isinstance(t, torch.Tensor) and t.dtype == torch.float32 and (t.is_meta or is_fake(t)) for t in tensors)


@contextlib.contextmanager
def fp32_grouped_mm_on_fake() -> Iterator[None]:
    """Lets fake and meta tensors run ``torch._grouped_mm`` in fp32, which the CPU kernel runs (transformers'
    mixture-of-experts layers call it) and torch 2.13's meta registration refuses ("Expected inputs of BF16 type"):
    what the memory estimator and the planner's probe need to run such a model as a fp32 run does. Below autograd, so
    autograd saves the fp32 inputs, as in the run."""
    with _Fp32GroupedMMShapes():
        yield
