"""A small decoder-only GPT (nanoGPT-style) and its LightningModule, with the tensor-parallel plan par3d applies.

Train it with par3d at dp=2 × tp=2 on 4 CPU processes::

    python examples/train.py experiment=demo

The model reads top to bottom. Attention derives its local head count from the width of its (possibly sharded)
projections, so the same code runs unsharded and under tensor parallelism.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics import SumMetric
from torchmetrics.classification import MulticlassAccuracy
from torchmetrics.text import Perplexity


@dataclass
class GPTConfig:
    vocab_size: int = 256  # byte tokens
    block_size: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    dropout: float = 0.0
    bias: bool = True


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        assert config.n_embd % config.n_head == 0, "n_embd must be a multiple of n_head"
        self.n_head = config.n_head  # tensor parallelism must divide this
        self.head_dim = config.n_embd // config.n_head
        # Separate q, k, v projections: sharding each by output columns gives every rank whole heads.
        self.q_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        # No key bias: it adds the same q·b to every score of a query, which softmax ignores, so its gradient is
        # exactly zero in theory and rounding noise in practice (that Adam would then amplify into updates).
        self.k_proj = nn.Linear(config.n_embd, config.n_embd, bias=False)
        self.v_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = config.dropout
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        # -1 is the local head count: n_head unsharded, n_head / tp under colwise q/k/v.
        q = self.q_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, heads, T, head_dim)
        k = self.k_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, heads, T, head_dim)
        v = self.v_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, heads, T, head_dim)
        dropout = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)  # (B, heads, T, head_dim)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, heads * head_dim)
        return self.resid_dropout(self.c_proj(y))  # (B, T, n_embd)


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))  # (B, T, n_embd)


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                # A ModuleDict keyed "0", "1", …: a pipeline stage deletes the blocks it does not own and every
                # other name stays as it is (checkpoints name parameters the same way at every layout).
                h=nn.ModuleDict({str(i): Block(config) for i in range(config.n_layer)}),
                ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
            )
        )
        # Untied head: a vocabulary-parallel lm_head and a vocabulary-parallel embedding shard differently.
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):  # GPT-2's scaled init of the residual projections
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        # Under pipeline parallelism a stage holds only some of these modules; the others are None.
        if self.transformer.wte is not None:  # first stage: token ids (B, T) → embeddings
            # position_ids: each token's place in its row; par3d's context parallelism passes the global ones of the
            # tokens a rank holds. By default 0 … T−1.
            pos = torch.arange(x.shape[1], device=x.device) if position_ids is None else position_ids  # (T,)
            x = self.transformer.drop(self.transformer.wte(x) + self.transformer.wpe(pos))  # (B, T, n_embd)
        for block in self.transformer.h.values():
            x = block(x)  # (B, T, n_embd)
        if self.lm_head is not None:  # last stage: embeddings → logits
            x = self.lm_head(self.transformer.ln_f(x))  # (B, T, vocab_size)
        return x


GPT_TP_PLAN = {
    "transformer.wte": "embedding_rowwise",  # vocabulary-parallel embedding
    "h.*.attn.q_proj": "colwise",
    "h.*.attn.k_proj": "colwise",
    "h.*.attn.v_proj": "colwise",
    "h.*.attn.c_proj": "rowwise",
    "h.*.mlp.c_fc": "colwise",
    "h.*.mlp.c_proj": "rowwise",
    "lm_head": "colwise_rep",  # vocabulary-parallel head; logits gathered for the loss
}
"""The GPT's tensor-parallel plan, in transformers' ``tp_plan`` vocabulary."""


class GPTModule(L.LightningModule):
    """Next-byte prediction with :class:`GPT`. The same module trains on one device and under any par3d layout."""

    tp_plan = GPT_TP_PLAN
    pipeline_trunk = "model"  # under pp > 1, par3d splits this module into stages ...
    pipeline_loss = "loss_fn"  # ... and applies this loss on the last stage

    def __init__(
        self,
        vocab_size: int = 256,
        block_size: int = 64,
        n_layer: int = 2,
        n_head: int = 4,
        n_embd: int = 64,
        dropout: float = 0.0,
        bias: bool = True,
        lr: float = 3e-3,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        warmup_steps: int = 0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.gpt_config = GPTConfig(vocab_size, block_size, n_layer, n_head, n_embd, dropout, bias)
        self.model: GPT | None = None
        # Evaluation metrics, updated where the logits are (the loss: under pp, the last stage) and logged per epoch.
        self.perplexity = Perplexity()
        self.accuracy = MulticlassAccuracy(num_classes=vocab_size, average="micro")  # next-byte accuracy
        self.tokens = SumMetric()  # tokens evaluated: every token counted once, at any layout

    def configure_model(self) -> None:
        if self.model is None:  # idempotent: Lightning may call it again, e.g. for trainer.validate
            self.model = GPT(self.gpt_config)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        assert self.model is not None
        return self.model(idx)

    def loss_fn(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if not self.training:  # validation and test: the metrics see every token once
            self.perplexity.update(logits, targets)
            self.accuracy.update(logits.argmax(-1), targets)
            self.tokens.update(targets.numel())
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())  # (B·T, vocab) against (B·T,)

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch  # (B, T), (B, T)
        return self.loss_fn(self(x), y)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        # sync_dist: the data-parallel mean, which under par3d's loss_mean="tokens" is the global batch's token mean
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self._evaluate(batch, "val")

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self._evaluate(batch, "test")

    def _evaluate(self, batch: tuple[torch.Tensor, torch.Tensor], stage: str) -> torch.Tensor:
        loss = self._loss(batch)
        self.log(f"{stage}_loss", loss, prog_bar=True, sync_dist=True)
        self.log(f"{stage}_ppl", self.perplexity, prog_bar=True)
        self.log(f"{stage}_acc", self.accuracy)
        self.log(f"{stage}_tokens", self.tokens)
        return loss

    def predict_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, _ = batch
        return self(x)  # (B, T, vocab_size) logits

    def configure_optimizers(self) -> Any:
        hp = self.hparams
        optimizer = torch.optim.AdamW(
            self.parameters(), lr=hp.lr, weight_decay=hp.weight_decay, betas=tuple(hp.betas), eps=hp.eps
        )
        if hp.warmup_steps == 0:
            return optimizer
        # Linear warm-up of the learning rate over the first `warmup_steps` optimizer steps.
        warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / hp.warmup_steps))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}
