"""Expert parallelism (``ep > 1``): a mixture-of-experts model's experts split whole over ``ep`` ranks of
``dp_shard``, the routed tokens sent to the rank holding their expert and back by all-to-all.

Which modules hold experts comes from the transformers model's own expert-parallel plan (its config's
``base_model_ep_plan``: the ``ep_dispatch_experts`` entries, ``layers.*.mlp.experts``), or from a LightningModule's
``ep_plan`` attribute of the same form. Such a module (transformers' ``*Experts``) runs
``forward(hidden_states, top_k_index, top_k_weights)`` over 3-D weights whose first dimension is the expert.

Each rank of an ``ep`` group holds ``num_experts / ep`` consecutive experts (its weights a DTensor ``Shard(0)`` over
the ``ep`` mesh), and its own tokens, since the ``ep`` ranks are data-parallel ranks. The router runs whole on every
rank, as in one process. Then, in :func:`routed_forward`:

1. each (token, choice) pair is sorted by its expert, and the counts per expert are exchanged (all-to-all);
2. the token rows go to the ranks that hold their experts (torch's functional ``all_to_all_single``, whose backward
   sends the gradients back the same way);
3. the module's own forward runs the rows it received through its local experts, each row with routing weight 1
   (the model's own expert math: activation, gate and up halves, biases, its chosen kernel);
4. the outputs come back by the reverse all-to-all and are weighted by the router's weights and summed per token,
   as the model's own forward sums them.

The experts are then sharded by FSDP2 over the ``dp_shard / ep`` ranks (× ``dp_replicate``) that hold the same
experts (:func:`shard_experts`). A local expert's gradient already sums the contributions of the tokens of every rank
of its ``ep`` group, so it is scaled by ``1 / ep`` in backward, and FSDP2's mean over the ``dp / ep`` ranks that
share it makes it the mean over the whole ``dp``, as the dense weights' is: each gradient is the single-process
gradient. (Not FSDP2's ``set_gradient_divide_factor``: on gloo it needs ``set_force_sum_reduction_for_comms``, and
torch 2.13 then divides twice where one rank holds each shard, ``dp_shard == ep``.)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_par3d.utils.patterns import is_transformers_model, matches
from lightning_par3d.utils.torch_private import all_to_all_with_autograd, is_fake, strided_shard

if TYPE_CHECKING:
    from torch.distributed.tensor import Shard

    from lightning_par3d.distributed.mesh import Par3DMesh

DISPATCH_STYLE = "ep_dispatch_experts"
"""The expert-parallel plan's style for a module of experts (transformers' name)."""


@dataclass(frozen=True)
class ExpertSpec:
    """The experts of a model, as its expert-parallel plan names them: the modules' full names, their classes (to
    find them again in a pipeline stage's copy) and the number of experts each holds."""

    names: tuple[str, ...]
    classes: tuple[type[nn.Module], ...]
    num_experts: int

    def modules_in(self, part: nn.Module) -> list[nn.Module]:
        """The modules of experts inside ``part`` (the whole model, or a pipeline stage)."""
        return [sub for sub in part.modules() if isinstance(sub, self.classes)]


def expert_plan(module: nn.Module) -> dict[str, str]:
    """The expert-parallel plan of ``module``: its ``ep_plan`` attribute (pattern → style), else the plan of the
    outermost transformers model inside (``config.base_model_ep_plan``), else empty. Patterns match the trailing
    parts of module names, as a tensor-parallel plan's do."""
    own = getattr(module, "ep_plan", None)
    if callable(own):
        own = own()
    if isinstance(own, Mapping):
        return dict(own)
    for sub in module.modules():
        plan = getattr(getattr(sub, "config", None), "base_model_ep_plan", None) if is_transformers_model(sub) else None
        if isinstance(plan, Mapping) and plan:
            return dict(plan)
    return {}


def find_experts(module: nn.Module, ep: int) -> ExpertSpec:
    """The experts of ``module`` that ``ep`` ranks split, checked: a model without a plan's experts, experts whose
    weights disagree on their count, or a count that ``ep`` does not divide, raise ``ValueError`` naming the fix.
    Runs on every rank alike before any data moves."""
    patterns = [pattern for pattern, style in expert_plan(module).items() if style == DISPATCH_STYLE]
    found = [(name, sub) for name, sub in module.named_modules() if any(matches(p, name) for p in patterns)]
    where = type(module).__name__
    if not found:
        raise ValueError(
            f"ep={ep} splits a mixture-of-experts model's experts over ranks, but {where} has no experts that an "
            "expert-parallel plan names (a transformers MoE model's config.base_model_ep_plan, or an `ep_plan` "
            f"attribute with {DISPATCH_STYLE!r} entries). Use ep=1 for this model."
        )
    adapted = [name for name, sub in found if hasattr(sub, "base_layer")]  # peft's wrapper (target_parameters)
    if adapted:
        raise ValueError(
            f"ep={ep} cannot split experts that carry LoRA adapters ({adapted[0]}, …: peft's `target_parameters` "
            "wraps the module of experts, whose adapters are not split by expert). Put the adapters on the attention "
            "and other linear layers (`target_modules`), or train the adapted experts with ep=1 (tp or FSDP2)."
        )
    counts = {p.shape[0] for _, sub in found for p in sub.parameters(recurse=False)}
    if len(counts) != 1:
        raise ValueError(
            f"The experts of {where} ({found[0][0]}, …) hold weights with different first dimensions {sorted(counts)}"
            ": expert parallelism splits every weight of a module of experts along its first dimension, the expert."
        )
    (num_experts,) = counts
    if num_experts % ep:
        divisors = [d for d in range(2, num_experts + 1) if num_experts % d == 0]
        raise ValueError(
            f"ep={ep} does not divide the {num_experts} experts of each layer of {where}: every ep rank must hold the "
            f"same number of whole experts. Use an ep among {divisors} (and dp_shard a multiple of it)."
        )
    classes = tuple(dict.fromkeys(type(sub) for _, sub in found))
    return ExpertSpec(tuple(name for name, _ in found), classes, num_experts)


def apply_expert_parallel(part: nn.Module, spec: ExpertSpec, mesh: Par3DMesh) -> int:
    """Splits the experts in ``part`` over the ``ep`` ranks (on the meta device, after tensor parallelism, before
    FSDP2) and routes their tokens by all-to-all; returns how many modules of experts it split.

    A weight the tensor-parallel plan already cut over tp (``moe_tp_experts``: each expert along its hidden size)
    becomes a DTensor over the experts' ``(ep, tp)`` mesh, ``Shard(0)`` over ep beside its tp placement; the tp
    style's own forward (partial outputs summed over tp) then runs on each rank's rows."""
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    ep_mesh = mesh["ep"]
    rank, size = ep_mesh.get_local_rank(), ep_mesh.size()
    n_local = spec.num_experts // size
    modules = spec.modules_in(part)
    for experts in modules:
        for name, param in list(experts.named_parameters(recurse=False)):
            if isinstance(param, DTensor):  # cut over tp: this rank's experts of its tp shard
                local = param.to_local()[rank * n_local : (rank + 1) * n_local]
                shard = DTensor.from_local(
                    local, mesh["ep_tp"], [Shard(0), *param.placements], run_check=False, shape=param.shape,
                    stride=param.stride(),
                )  # fmt: skip
            else:
                shard = distribute_tensor(param, ep_mesh, [Shard(0)], src_data_rank=None)
            experts.register_parameter(name, nn.Parameter(shard, requires_grad=param.requires_grad))
        experts.forward = _routed(experts, experts.forward, ep_mesh.get_group(), n_local)
    return len(modules)


def shard_experts(part: nn.Module, spec: ExpertSpec, mesh: Par3DMesh, **fsdp: Any) -> None:
    """FSDP2 over each module of experts in ``part``, on the ranks that hold the same experts (before the blocks
    that contain them are wrapped): sharded along each weight's last dimension that neither ep nor tp splits.
    FSDP2 averages each gradient over those ``dp / ep`` ranks; the local gradients were scaled by ``1 / ep`` in
    backward (:func:`_local_view`), so each is the mean over the whole ``dp``."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    def placement(param: Any) -> Shard:  # the last dimension neither ep nor tp splits
        split = {p.dim for p in param.placements if isinstance(p, (Shard, strided_shard()))}
        return Shard(max(d for d in range(param.ndim) if d not in split))

    for experts in spec.modules_in(part):
        fully_shard(experts, mesh=mesh["expert_fsdp"], shard_placement_fn=placement, **fsdp)


def _routed(experts: nn.Module, original: Callable[..., Any], group: Any, n_local: int) -> Callable[..., Any]:
    def forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        def run_local(rows: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
            with _local_view(experts, n_local):
                out = original(rows, local_ids[:, None], torch.ones_like(local_ids, dtype=rows.dtype)[:, None])
                if rows.shape[0] == 0:  # no token came: the local experts still get their (zero) gradients, as in
                    out = out + sum(p.sum() * 0 for p in experts.parameters())  # one process, where every
            return out  # expert of a layer is one weight with one gradient

        return routed_forward(run_local, hidden_states, top_k_index, top_k_weights, group, n_local)

    return forward


class _ScaledGradient(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by ``scale``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


@contextmanager
def _local_view(experts: nn.Module, n_local: int) -> Iterator[None]:
    """Inside, the module's weights read as this rank's experts (the DTensors' local shards, differentiable, their
    gradients scaled by ``1 / ep``: see :func:`shard_experts`), and its ``num_experts`` (which its kernels size their
    bins by) as their count."""
    from torch.distributed.tensor import DTensor

    saved = dict(experts._parameters)
    count = getattr(experts, "num_experts", None)
    try:
        for name, param in saved.items():
            if isinstance(param, DTensor):
                ep = param.device_mesh.size(list(param.device_mesh.mesh_dim_names or ()).index("ep"))
                experts._parameters[name] = _ScaledGradient.apply(param.to_local(), 1.0 / ep)
        if count is not None:
            setattr(experts, "num_experts", n_local)  # noqa: B010 (an int where nn.Module types attributes as modules)
        yield
    finally:
        experts._parameters.update(saved)
        if count is not None:
            setattr(experts, "num_experts", count)  # noqa: B010


@torch.compiler.disable  # data-dependent sizes and collectives with autograd: eager, between compiled parts
def routed_forward(
    run_local: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    index: torch.Tensor,
    weights: torch.Tensor,
    group: Any,
    n_local: int,
) -> torch.Tensor:
    """The experts' output for this rank's tokens (``hidden``: tokens × width; ``index`` and ``weights``: tokens ×
    top-k, the router's choices by global expert number and their weights), each token's chosen experts run on the
    ranks of ``group`` that hold them (rank ``r`` holds experts ``r·n_local … (r+1)·n_local − 1``) by
    ``run_local(rows, local_expert_ids)``."""
    ep = dist.get_world_size(group)
    top_k = index.shape[1]
    flat = index.reshape(-1)
    order = torch.argsort(flat, stable=True)  # the (token, choice) pairs by expert, so by destination rank
    token_of = order // top_k
    if is_fake(flat) or dist.get_backend(group) == "fake":
        # The estimator's step (fake tensors: sizes only) or a dry run (the fake backend's all-to-all delivers
        # nothing): each rank taken to receive from every other what it sends it, spread evenly over its experts.
        pairs = len(flat)
        send = [pairs // ep + (r < pairs % ep) for r in range(ep)] if is_fake(flat) else _per_rank(flat, ep, n_local)
        receive = send
        local_ids = _spread(receive, n_local, flat.device)
    else:
        counts = torch.bincount(flat, minlength=ep * n_local)
        arriving = torch.empty_like(counts)
        dist.all_to_all_single(arriving, counts, group=group)  # [source rank, local expert]: rows about to arrive
        send = counts.view(ep, n_local).sum(1).tolist()
        by_source = arriving.view(ep, n_local)
        receive = by_source.sum(1).tolist()
        local_ids = torch.arange(n_local, device=flat.device).repeat(ep).repeat_interleave(by_source.reshape(-1))
    rows = hidden.index_select(0, token_of)
    arrived = all_to_all_with_autograd(rows, receive, send, group)
    by_expert = torch.argsort(local_ids, stable=True)
    done = run_local(arrived.index_select(0, by_expert), local_ids.index_select(0, by_expert))
    done = torch.zeros_like(done).index_copy(0, by_expert, done)  # back in arrival order
    returned = all_to_all_with_autograd(done, send, receive, group)
    routing = weights.reshape(-1).index_select(0, order).unsqueeze(-1)
    return torch.zeros_like(hidden).index_add(0, token_of, (returned * routing).to(hidden.dtype))


def _per_rank(flat: torch.Tensor, ep: int, n_local: int) -> list[int]:
    """How many of the (token, choice) pairs in ``flat`` go to each rank."""
    return torch.bincount(flat, minlength=ep * n_local).view(ep, n_local).sum(1).tolist()


def _spread(rows_from: list[int], n_local: int, device: torch.device) -> torch.Tensor:
    """The local expert of each row received (``rows_from[s]`` rows from source ``s``, in arrival order), each
    source's rows spread evenly over the ``n_local`` experts, in expert order (sizes only: no data decides them)."""
    ids = []
    for rows in rows_from:
        per_expert = [rows // n_local + (e < rows % n_local) for e in range(n_local)]
        ids += [torch.full((n,), e, dtype=torch.long, device=device) for e, n in enumerate(per_expert)]
    return torch.cat(ids)
