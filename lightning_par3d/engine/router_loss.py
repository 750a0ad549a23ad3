"""A mixture-of-experts transformers model's load-balancing loss over the global batch, as one process computes it.

With ``output_router_logits=True`` a transformers MoE causal LM (Qwen3-MoE, Mixtral, Qwen2-MoE, OLMoE, …) adds
``router_aux_loss_coef · aux`` to its loss, where ``aux = E · Σ_e f_e · P_e`` over every layer's router: ``f_e`` the
share of routed (token, choice) pairs that went to expert ``e`` and ``P_e`` its mean router probability, both over
the batch's (unmasked) rows (Switch Transformer's loss, ``load_balancing_loss_func`` in the model's module). The loss
is a product of two batch means, not a mean of per-token terms: computed on each data-parallel rank's own rows and
averaged, it is not the global batch's (a tiny Qwen3-MoE at ``dp_shard=2``, coefficient 0.1: 1.5e-3 from one
process at the first step, 15× the parity bar).

``f_e`` has no gradient (a top-k count), so the global loss's gradient is ``E / R² · Σ_e c_e · ∇p_e`` with ``c_e``
and ``R`` (the routed pairs per expert and the rows, over the global batch) summed over the data-parallel ranks, and
``p_e`` each rank's own probability sums. Each rank's term is therefore ``dp · E · Σ_e c_e · p_e / R²``: the ranks'
terms average to the global loss, and so do their gradients under the data-parallel mean. The sums ``c_e`` and ``R``
are one all-reduce of ``E + 1`` numbers per step, over the data-parallel ranks (tensor-parallel ranks hold the same
tokens).

The model calls its module's ``load_balancing_loss_func`` by name inside its ``forward``; par3d's version stands in
for it there, during that model's training forwards only (:func:`install`), and its local sums are checked once
against the model's own function on the same rows, so a model whose loss differs is refused rather than trained on
another loss. Where the global batch is more than one forward (gradient accumulation, pipeline microbatches), the
counts of the batches not run yet are unknown when the first one's backward runs: refused, naming the fix.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lightning_par3d.utils.model_changes import set_attribute
from lightning_par3d.utils.patterns import find_transformers_model

_ORIGINAL = "_par3d_model_forward"
"""The attribute of par3d's forward that holds the model's own (bound) one."""
OWN_FUNCTION = "load_balancing_loss_func"
"""The function a transformers MoE model's module defines and its ``forward`` calls by this name."""


def install(module: nn.Module, dp: int, dp_group: Callable[[], Any], accumulation: Callable[[], int]) -> bool:
    """Makes the load-balancing loss of the transformers MoE model in ``module`` (pp = 1) the global batch's (see
    the module docstring); whether there was one to make. ``dp_group()``: the data-parallel group (None for one
    rank); ``accumulation()``: the batches per optimizer step. Installing again (another engine) wraps the model's
    own ``forward``, not the earlier wrapper."""
    found = find_transformers_model(module)
    if found is None:
        return False
    model = found[1]
    home = sys.modules.get(type(model).__module__) if type(model).__module__ else None
    own = getattr(home, OWN_FUNCTION, None)
    if home is None or not callable(own):
        return False
    forward = getattr(model.forward, _ORIGINAL, model.forward)  # (not __wrapped__: transformers' decorators set it)
    state = _GlobalRouterLoss(own, dp, dp_group, accumulation)

    def global_loss_forward(*args: Any, **kwargs: Any) -> Any:
        if not (model.training and torch.is_grad_enabled()):
            return forward(*args, **kwargs)
        with _standing_in(home, state):
            return forward(*args, **kwargs)

    setattr(global_loss_forward, _ORIGINAL, forward)
    set_attribute(model, "forward", global_loss_forward)
    return True


@contextmanager
def _standing_in(home: Any, state: _GlobalRouterLoss) -> Iterator[None]:
    saved = getattr(home, OWN_FUNCTION)
    setattr(home, OWN_FUNCTION, state)
    try:
        yield
    finally:
        setattr(home, OWN_FUNCTION, saved)


class _GlobalRouterLoss:
    """``load_balancing_loss_func(gate_logits, num_experts, top_k, attention_mask)`` of the global batch: this rank's
    term, ``dp · E · Σ_e c_e · p_e / R²`` (see the module docstring)."""

    def __init__(self, own: Callable[..., Any], dp: int, dp_group: Callable[[], Any], accumulation: Callable[[], int]):
        self.own, self.dp, self.dp_group, self.accumulation = own, dp, dp_group, accumulation
        self.checked = False

    def __call__(self, gate_logits: Any, num_experts: int | None = None, top_k: int = 2,
                 attention_mask: torch.Tensor | None = None) -> Any:  # fmt: skip
        if gate_logits is None or not isinstance(gate_logits, tuple) or num_experts is None:
            return self.own(gate_logits, num_experts, top_k, attention_mask)
        if self.accumulation() > 1:
            raise ValueError(
                f"The model's router load-balancing loss (output_router_logits=True) is a product of two means over "
                f"the global batch, whose {self.accumulation()} accumulated batches par3d cannot route before the "
                "first one's backward. Drop the accumulation (a larger batch per step), or set "
                "output_router_logits=False."
            )
        counts, probs, rows = _sums(gate_logits, num_experts, top_k, attention_mask)
        differs = None
        if not self.checked:
            self.checked = True
            differs = self._differs(gate_logits, num_experts, top_k, attention_mask, counts, probs, rows)
        # One all-reduce: the counts, the rows, and (the first time) how many ranks found a different loss, so that
        # every rank raises alike rather than some waiting in the next collective.
        summed = torch.cat([counts, rows.reshape(1), counts.new_tensor([float(differs is not None)])])
        summed = summed.to(torch.float64)
        group = self.dp_group()
        if group is not None:
            dist.all_reduce(summed, group=group)
        if summed[-1] > 0:
            raise ValueError(
                f"The model's {OWN_FUNCTION} differs from the Switch Transformer loss par3d computes over the global "
                f"batch ({differs or 'on another data-parallel rank'}): par3d does not know how to make this model's "
                "load-balancing loss the global batch's. Set output_router_logits=False, or train with one "
                "data-parallel rank."
            )
        counts_all, rows_all = summed[:-2].to(probs.dtype), summed[-2].to(probs.dtype)
        return self.dp * num_experts * (counts_all * probs).sum() / rows_all**2

    def _differs(self, gate_logits: tuple, num_experts: int, top_k: int, attention_mask: Any, counts: torch.Tensor,
                 probs: torch.Tensor, rows: torch.Tensor) -> str | None:  # fmt: skip
        """How the model's own function's loss on these rows differs from the one these sums give (None: it does
        not; else its loss is not the one par3d makes global)."""
        with torch.no_grad():
            own = self.own(tuple(g.detach() for g in gate_logits), num_experts, top_k, attention_mask)
            mine = num_experts * (counts * probs.detach()).sum() / rows**2
        if torch.allclose(torch.as_tensor(own, dtype=mine.dtype), mine, rtol=1e-5, atol=1e-7):
            return None
        return f"{float(own):.6g} against {float(mine):.6g} on this rank's routing"


def _sums(gate_logits: tuple, num_experts: int, top_k: int,
          attention_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Over every layer's router logits and the unmasked rows: the (token, choice) pairs routed to each expert (no
    gradient), the sum of each expert's router probabilities, and the rows."""
    device = gate_logits[0].device
    counts = torch.zeros(num_experts, dtype=torch.float32, device=device)
    probs = torch.zeros(num_experts, dtype=torch.float32, device=device)
    rows = torch.zeros((), dtype=torch.float32, device=device)
    mask = None if attention_mask is None else attention_mask.reshape(-1).to(device=device, dtype=torch.float32)
    for logits in gate_logits:
        weights = F.softmax(logits.to(device), dim=-1)
        _, chosen = torch.topk(weights, top_k, dim=-1)
        if mask is None:
            counts = counts + torch.bincount(chosen.reshape(-1), minlength=num_experts).to(torch.float32)
            probs = probs + weights.float().sum(dim=0)
            rows = rows + weights.shape[0]
        else:
            counts = counts.index_add(0, chosen.reshape(-1), mask.repeat_interleave(top_k))
            probs = probs + (weights.float() * mask.unsqueeze(-1)).sum(dim=0)
            rows = rows + mask.sum()
    return counts.detach(), probs, rows


def refuse_under_pipelining(module: nn.Module) -> None:
    """Raises where the transformers model in ``module`` adds its router's loss (``output_router_logits=True``):
    pipeline stages run the model's parts and the declared ``pipeline_loss``, never its ``forward``, which is
    where that loss is added; training on would silently leave it out."""
    found = find_transformers_model(module)
    if found is not None and getattr(getattr(found[1], "config", None), "output_router_logits", False):
        raise ValueError(
            f"{type(found[1]).__name__} adds its router's load-balancing loss in its forward (config."
            "output_router_logits=True), which pipeline stages do not run: under pp > 1 the loss would be left out. "
            "Set output_router_logits=False, or train without pipelining (pp=1)."
        )
