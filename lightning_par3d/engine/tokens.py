"""The step's loss as the token mean of the global batch, at every layout (``loss_mean="tokens"``, the default).

One process computing a token-mean loss on the whole global batch divides the summed token losses by the global
batch's real-token count ``N``. Split over pipeline microbatches, data-parallel ranks and accumulated batches, each
piece's own mean weighs its tokens by one over its own count, which is not ``1/N`` where the pieces hold different
numbers of real tokens (padded or variable-length data). par3d therefore scales each piece's mean ``m`` (over its
``c`` real tokens) to its *share*

    m · c · dp · w / N

— its summed token losses ``m · c``, times ``dp`` because the data-parallel reduction averages the ranks' gradients,
times ``w`` (the batches of the accumulation window) because the window's batches are averaged — and the backward
takes ``1/w`` of the share: after the data-parallel average and the accumulation, the gradient is that of the global
batch's summed token losses over ``N``. A batch's loss value, averaged over the data-parallel ranks (``sync_dist``,
``strategy.reduce``) and over the window's batches, is the global batch's token mean.

``N`` is known before the first piece's backward (counted before the step, as torchtitan and Hugging Face's Trainer
count it):

* without gradient accumulation it is the count of the batch's targets summed over the data-parallel ranks, taken at
  the loss (under pp, before the schedule, from the whole batch's targets);
* with accumulation the training dataloader reads each window ahead (:class:`TokenWindows`) and counts the real tokens
  of its batches where ``loss_tokens`` says the targets are; the window's first training batch sums the count over the
  data-parallel ranks, and the loss checks that it counted what the window counted.

Real tokens are the targets not equal to ``ignore_index`` (integer targets), or every element (float targets).
"""

from __future__ import annotations

import itertools
import warnings
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_par3d.utils.model_changes import set_attribute
from lightning_par3d.utils.patterns import find_transformers_model

LossFn = Callable[..., torch.Tensor]

DECLARED, TRANSFORMERS, NONE = "declared", "transformers", "none"
"""Where a module's training loss is scaled: its declared ``pipeline_loss`` method, its transformers model's own
``loss_function``, or nowhere par3d can see (each batch's own mean)."""


@dataclass(frozen=True)
class BatchTokens:
    """A training batch's place in its step, read ahead by :class:`TokenWindows`."""

    total: int
    """``N``: the real tokens of the step's global batch (every data-parallel rank, every batch of the window)."""
    batches: int
    """``w``: the batches of the accumulation window (fewer than the accumulation for an epoch's last window)."""
    counted: int
    """This rank's real tokens in this batch, as the window counted them."""
    index: int = 0
    """Its place in its window; ``batch``: it as read; ``later``: at a window's first, the others (routed ahead)."""
    batch: Any = None
    later: tuple[Any, ...] = ()


def real_tokens(targets: Any, ignore_index: int) -> torch.Tensor:
    """The real tokens of ``targets``: those not equal to ``ignore_index`` (integer targets), or every element
    (float targets); an int64 scalar on the targets' device."""
    if not isinstance(targets, torch.Tensor):
        raise TypeError(
            f"loss_mean='tokens' counts the real tokens of the loss's targets, which must be a tensor (got "
            f"{type(targets).__name__}). Set loss_mean='microbatches' for a loss whose targets are not."
        )
    if targets.is_floating_point() or targets.is_complex():
        return torch.tensor(targets.numel(), dtype=torch.int64, device=targets.device)
    return (targets != ignore_index).sum()


def batch_targets(batch: Any, where: str | int | None, shift: bool) -> torch.Tensor:
    """The targets a training batch's loss counts: ``batch[where]`` (None: a dict's ``"labels"``, a tuple's last
    element), their positions after the first along the last dimension where the loss shifts them (a transformers
    causal LM computing its own loss)."""
    key: str | int = where if where is not None else ("labels" if isinstance(batch, Mapping) else -1)
    try:
        targets = batch[key]
    except (KeyError, IndexError, TypeError):
        raise ValueError(
            f"loss_mean='tokens' with gradient accumulation reads each window's targets ahead, but a training batch "
            f"of type {type(batch).__name__} has no {key!r}. Set loss_tokens= to the key (dict batches) or index "
            "(tuple batches) of the targets the loss counts, or set loss_mean='microbatches'."
        ) from None
    if not isinstance(targets, torch.Tensor):
        raise ValueError(f"loss_tokens={key!r} names a {type(targets).__name__} in the batch, not the targets tensor.")
    return targets[..., 1:] if shift else targets


class TokenMean:
    """One engine's token-mean state. ``dp_group()`` gives the data-parallel group the counts are summed over (None:
    one data-parallel rank), ``device()`` where its collectives run (NCCL takes CUDA tensors), ``accumulation()`` the
    batches per optimizer step the front-end runs."""

    def __init__(
        self,
        ignore_index: int,
        dp: int,
        dp_group: Callable[[], Any],
        device: Callable[[], torch.device],
        accumulation: Callable[[], int],
        where: str | int | None = None,
    ) -> None:
        self.ignore_index, self.dp, self.where = ignore_index, dp, where
        self.dp_group, self.device, self.accumulation = dp_group, device, accumulation
        self.source = NONE
        """Where the module's own training loss is scaled (:func:`install`); ``train_step``'s ``loss_fn`` always is."""
        self.reading: list[TokenWindows] = []
        """The read-ahead dataloaders being read, latest last (:func:`_training_source` says which a batch is from)."""
        self.current: BatchTokens | None = None
        self.cut: Callable[[torch.Tensor, bool], torch.Tensor] | None = None
        """Under cp > 1: ``cut(targets, shifted)``, a batch's targets at this rank's positions (its loss counts)."""
        self._shared = self._checked = self._warned = False

    @classmethod
    def of(cls, placement: Any, accumulation: Callable[[], int]) -> TokenMean:
        """The token mean of an engine's placement (its configuration's ``ignore_index`` and ``loss_tokens``, its
        data-parallel ranks and device), with the front-end's batches per optimizer step."""
        config, dp = placement.config, placement.layout.dp_cp
        group = (lambda: placement.dp_group()) if dp > 1 else (lambda: None)
        return cls(config.ignore_index, dp, group, lambda: placement.device, accumulation, config.loss_tokens)

    # ---------------------------------------------------------------- a training batch
    def start_batch(self) -> None:
        """A training batch begins: its entry from the dataloader that read it ahead (its window's count summed
        over the data-parallel ranks at the window's first batch). Without accumulation the batch is a window of its
        own, counted at its loss."""
        self.current, self._shared = None, False
        if self.accumulation() > 1:
            source = _training_source(self.reading)
            if source is not None:
                self.current = source.take(self)

    def batches(self) -> int:
        """``w``: the batches of the current batch's window."""
        return self.current.batches if self.current is not None else 1

    def total(self, count: torch.Tensor) -> torch.Tensor:
        """``N`` for a batch whose targets hold ``count`` real tokens on this rank: the window's, or ``count``
        summed over the data-parallel ranks (a collective)."""
        if self.current is not None:
            self._check(int(count))
            return torch.tensor(float(self.current.total), device=count.device)
        if self.accumulation() > 1:
            raise RuntimeError(
                f"loss_mean='tokens' with {self.accumulation()} accumulated batches per step counts each window's "
                "tokens ahead, but this batch did not come through a dataloader par3d set up (the Trainer's, Fabric's "
                "setup_dataloaders, Accelerate's prepare) inside a training step (the Trainer's, Fabric's or "
                "Accelerate's train_step, Accelerate's accumulate()). Train from such a dataloader and step, or set "
                "loss_mean='microbatches'."
            )
        return self.sum_over_dp([float(count)])[0].to(count.device, torch.float32)

    def sum_over_dp(self, values: list[float]) -> torch.Tensor:
        """``values`` summed over the data-parallel ranks (float64, on the collective's device)."""
        summed = torch.tensor(values, dtype=torch.float64, device=self.device())
        group = self.dp_group()
        if group is not None:
            dist.all_reduce(summed, group=group)
        return summed

    def scale(self, mean: torch.Tensor, count: torch.Tensor, total: torch.Tensor, batches: int) -> torch.Tensor:
        """A piece's mean loss ``mean`` over its ``count`` real tokens, as its share of the global batch's token mean
        (see the module docstring): ``mean · count · dp · w / N``."""
        if int(total) == 0:
            raise ValueError(
                "The global batch holds no real tokens: every target equals ignore_index="
                f"{self.ignore_index}. Check the labels (or ignore_index)."
            )
        self._shared = True
        share = count.to(mean.dtype) * (self.dp * batches) / total.to(mean.dtype)
        return torch.where(count > 0, mean, 0.0) * share  # a piece without real tokens (its mean NaN) adds nothing

    def backward_factor(self, divided_by: int) -> float:
        """What a front-end multiplies a training loss by before its backward, when its framework divides the loss by
        ``divided_by`` (the accumulation) itself: ``divided_by / w`` for a share, so that the backward takes ``1/w``
        of it; 1 for a loss par3d did not scale (said once)."""
        shared, self._shared = self._shared, False
        if shared:
            return divided_by / self.batches()
        if self.source != NONE and not self._warned:
            self._warned = True
            if dist.is_initialized() and dist.get_rank() != 0:
                return 1.0
            warnings.warn(
                f"loss_mean='tokens': the training step's loss did not come from the module's {self.source} loss, so "
                "par3d could not scale it: the step averages each batch's own mean, not the global batch's token "
                "mean. Compute it through the declared loss method (pipeline_loss = 'loss_fn' on the module, then "
                "loss = self.loss_fn(self(x), y) in training_step) or the transformers model's own labels= loss, "
                "or set loss_mean='microbatches' to silence this.",
                stacklevel=3,
            )
        return 1.0

    def wrap(self, loss_fn: LossFn, targets_at: Callable[..., Any] | None = None) -> LossFn:
        """``loss_fn`` as the piece's share of the global token mean, in training (with gradients on); the loss as
        it is otherwise. ``targets_at(*args, **kwargs)`` finds the targets among the loss's arguments (default: its
        second positional one)."""

        def scaled(*args: Any, **kwargs: Any) -> torch.Tensor:
            mean = loss_fn(*args, **kwargs)
            if not torch.is_grad_enabled():
                return mean
            targets = targets_at(*args, **kwargs) if targets_at is not None else args[1]
            count = real_tokens(targets, self.ignore_index)
            return self.scale(mean, count, self.total(count), self.batches())

        scaled.__wrapped__ = loss_fn  # type: ignore[attr-defined]
        return scaled

    def _check(self, count: int) -> None:
        """The loss counted what its window counted (with every data-parallel rank the first time, then locally)."""
        assert self.current is not None
        wrong = count != self.current.counted
        if not self._checked:  # the first time, every data-parallel rank raises alike, rather than some waiting
            self._checked = True
            wrong = bool(self.sum_over_dp([float(wrong)])[0].item())
        if wrong:
            raise ValueError(
                f"loss_mean='tokens': the loss counted {count} real tokens in its targets, but reading the training "
                f"batch ahead counted {self.current.counted} in the batch's targets (loss_tokens= says where they "
                "are: a dict's 'labels' or a tuple's last element by default, shifted by one for a transformers "
                "model's own loss). Set loss_tokens= to where the loss's targets are, or loss_mean='microbatches'."
            )


@dataclass
class _Window:
    """One accumulation window as read ahead: each batch's count on this rank (or why it could not be counted), the
    window's total over the data-parallel ranks once its first batch is trained, its batches until its last is."""

    counts: list[int]
    error: Exception | None = None
    total: int | None = None
    read: list[Any] = field(default_factory=list)


class TokenWindows:
    """A dataloader read one accumulation window ahead: each window's batches are counted (where ``loss_tokens`` says
    the targets are) before its first batch is yielded. Reading and counting do nothing else: the window's count is
    summed over the data-parallel ranks when its first batch is trained (:meth:`take`), a batch that cannot be
    counted fails there, and a dataloader that is only evaluated (Fabric and Accelerate cannot tell which a loader is)
    only reads ahead. ``limit()`` caps the batches an epoch reads (the Trainer's ``num_training_batches``). Everything
    else (its length, its sampler, which the frameworks set the epoch of) is the dataloader's."""

    def __init__(self, loader: Any, tokens: TokenMean, shift: Callable[[], bool], limit: Callable[[], float]) -> None:
        self.loader, self.tokens, self.shift, self.limit = loader, tokens, shift, limit
        self._batches: deque[tuple[_Window, int]] = deque(maxlen=16)
        self.ended = False
        self.trained = False
        """Whether a training step took a batch from it (a training dataloader, not only an evaluation one)."""

    def __iter__(self) -> Iterator[Any]:
        accumulation = self.tokens.accumulation()
        if accumulation == 1:
            yield from self.loader
            return
        limit = self.limit()
        batches = iter(self.loader) if limit == float("inf") else itertools.islice(self.loader, int(limit))
        self._batches.clear()
        # an epoch begins: dataloaders whose epochs ended are no longer trained from (their last batches are)
        self.tokens.reading[:] = [w for w in self.tokens.reading if not w.ended and w is not self] + [self]
        self.ended = False
        while read := list(itertools.islice(batches, accumulation)):
            window = self._count(read)
            for index, batch in enumerate(read):
                self._batches.append((window, index))
                yield batch
        self.ended = True  # its last batches may still be trained: a consumer may read ahead of its training step

    def take(self, tokens: TokenMean) -> BatchTokens:
        """The next trained batch's entry (a collective over the data-parallel ranks at a window's first batch)."""
        if not self._batches:
            raise RuntimeError("loss_mean='tokens': a training batch began, but its dataloader yielded none for it.")
        window, index = self._batches.popleft()
        self.trained = True
        if window.total is None:
            # one collective with every rank's outcome: a rank that could not count does not leave the others waiting
            summed = tokens.sum_over_dp([float(sum(window.counts)), float(window.error is not None)])
            if window.error is not None:
                raise window.error
            if summed[1].item() > 0:
                raise RuntimeError("loss_mean='tokens': another data-parallel rank could not count its batch's tokens.")
            window.total = int(summed[0].item())
        read, later = window.read, tuple(window.read[1:]) if index == 0 else ()
        window.read = read if index < len(read) - 1 else []  # the window's last batch: not held any longer
        return BatchTokens(window.total, len(window.counts), window.counts[index], index, read[index], later)

    def _count(self, read: list[Any]) -> _Window:
        try:
            shift, where, ignore, cut = self.shift(), self.tokens.where, self.tokens.ignore_index, self.tokens.cut
            targets = [batch_targets(b, where, shift) for b in read]
            targets = [cut(t, shift) for t in targets] if cut is not None else targets
            return _Window([int(real_tokens(t, ignore)) for t in targets], read=read)
        except (ValueError, TypeError) as error:
            return _Window([0] * len(read), error, read=read)

    def pending(self) -> bool:
        """Whether batches it yielded wait for their training step."""
        return bool(self._batches)

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)


def _training_source(reading: list[TokenWindows]) -> TokenWindows | None:
    """The dataloader a training batch came from: the latest one trained from before with batches waiting, else the
    latest with batches waiting. (Fabric and Accelerate evaluate from dataloaders set up alike; a loop may evaluate in
    the middle of a training epoch, whose dataloader has read ahead of its training step.)"""
    waiting = [w for w in reading if w.pending()]
    trained = [w for w in waiting if w.trained]
    candidates = trained or waiting
    return candidates[-1] if candidates else None


# ---------------------------------------------------------------- where par3d sees the loss


def install(module: nn.Module, tokens: TokenMean) -> str:
    """Makes the training loss of ``module`` (pp = 1) its share of the global token mean: the declared pipeline loss,
    else a transformers model's ``loss_function`` (counting the labels shifted by one); records and returns which
    (:data:`DECLARED`, :data:`TRANSFORMERS`, :data:`NONE`). Installing again wraps the original loss, not a wrapper."""
    tokens.source = NONE
    loss_attr = getattr(module, "pipeline_loss", None)
    if isinstance(loss_attr, str) and callable(getattr(module, loss_attr, None)):
        set_attribute(module, loss_attr, tokens.wrap(_unwrapped(getattr(module, loss_attr))))
        tokens.source = DECLARED
    elif (found := find_transformers_model(module)) is not None and callable(getattr(found[1], "loss_function", None)):
        model = found[1]
        set_attribute(model, "_loss_function", _transformers_loss(tokens, _unwrapped(model.loss_function)))
        tokens.source = TRANSFORMERS
    return tokens.source


def source_for(module: nn.Module, tokens: TokenMean, spec: Any) -> str:
    """Where ``module``'s training loss is scaled: for pp = 1 (``spec`` None) where :func:`install` wraps it; under pp
    the declared loss, else the transformers model's own (labels shifted), each inside the schedule as its share."""
    return install(module, tokens) if spec is None else TRANSFORMERS if spec.loss is None else DECLARED


def _transformers_loss(tokens: TokenMean, loss_function: LossFn) -> LossFn:
    """A transformers ``loss_function`` (``ForCausalLMLoss(logits, labels, vocab_size, num_items_in_batch=None,
    ignore_index=-100, shift_labels=None, ...)``) as its share of the global token mean. A call that gives
    ``num_items_in_batch`` normalizes by itself and is left as it is."""

    def targets_at(*args: Any, **kwargs: Any) -> Any:
        shifted = kwargs.get("shift_labels")
        if shifted is not None:
            return shifted
        labels = kwargs["labels"] if "labels" in kwargs else args[1]
        return labels[..., 1:]

    scaled = tokens.wrap(loss_function, targets_at)

    def loss(*args: Any, **kwargs: Any) -> torch.Tensor:
        if kwargs.get("num_items_in_batch") is not None:
            return loss_function(*args, **kwargs)
        return scaled(*args, **kwargs)

    loss.__wrapped__ = loss_function  # type: ignore[attr-defined]
    return loss


def _unwrapped(loss: Any) -> Any:
    while hasattr(loss, "__wrapped__") and (loss.__module__ == __name__ or hasattr(loss, "_par3d_loss_wrapper")):
        loss = loss.__wrapped__
    return loss


def pipeline_share(tokens: TokenMean, targets: Any) -> tuple[Callable[[torch.Tensor, Any], torch.Tensor], int]:
    """For one pipelined training batch with ``targets``: each microbatch's share of the global token mean
    (``share(mean, microbatch_targets)``), with ``N`` taken once for the batch, and ``w``."""
    total = tokens.total(real_tokens(targets, tokens.ignore_index))
    batches = tokens.batches()

    def share(mean: torch.Tensor, microbatch_targets: Any) -> torch.Tensor:
        return tokens.scale(mean, real_tokens(microbatch_targets, tokens.ignore_index), total, batches)

    return share, batches


def read_ahead(tokens: TokenMean | None, loader: Any, limit: Callable[[], float] = lambda: float("inf")) -> Any:
    """A dataloader as a front-end hands it to the loop: under ``loss_mean="tokens"`` (``tokens`` not None) read one
    accumulation window ahead (:class:`TokenWindows`, which passes batches through while the accumulation is 1);
    else as it is. The targets counted are shifted by one where the module's loss is a transformers model's own."""
    if tokens is None or isinstance(loader, TokenWindows):
        return loader
    return TokenWindows(loader, tokens, lambda: tokens.source == TRANSFORMERS, limit)
