"""A Hugging Face transformers causal LM, unchanged, as a LightningModule that par3d trains at any layout.

The model is transformers' own (``AutoModelForCausalLM.from_config``): a tiny random Llama by default, any
architecture transformers knows (``architecture="qwen2"``, ``"mistral"``, …), or a real checkpoint's
(``pretrained_path=``: the config comes from the directory, and the strategy's ``init="pretrained"`` reads its
weights into each rank's shards). Three attributes are all par3d needs:

* ``tp_plan = "auto"``: the transformers model's own tensor-parallel plan;
* ``pipeline_trunk = "model"``: under pp > 1 par3d splits the transformers model into stages itself (embedding
  first, decoder layers balanced, final norm and LM head last), keeping every parameter's name;
* ``pipeline_loss = "loss_fn"``: the loss the last stage applies to the logits.

``own_loss=True`` trains through the model's own ``labels=`` loss instead (``self.model(input_ids=x, labels=x).loss``,
at any layout, pp included), which adds a mixture of experts' router load-balancing loss where its config has
``output_router_logits=True``.

``lora=`` (a ``peft.LoraConfig``'s fields) fine-tunes LoRA adapters on the frozen model; ``adapter_path=`` starts
them from adapters ``PeftModel.save_pretrained`` (or par3d's ``SavePretrained``) wrote.

It reads the same byte-level data as the example GPT (token ids 0–255, valid ids of any vocabulary of at least
256 tokens); bring a tokenized DataModule to fine-tune a real checkpoint on real text.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics import SumMetric
from torchmetrics.text import Perplexity


def logits_of(output: Any) -> Any:
    """The logits of a transformers model's output (a ``ModelOutput``); anything else as it is (a pipeline stage's
    output, which par3d hands to the loss)."""
    return getattr(output, "logits", output)


def _plain(value: Any) -> Any:
    """Hydra's configs (``DictConfig``, ``ListConfig``) as the plain dicts and lists peft's configs write as JSON."""
    if isinstance(value, Mapping):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, Sequence) and not isinstance(value, str):
        return [_plain(item) for item in value]
    return value


class CausalLMModule(L.LightningModule):
    """Next-token prediction with a transformers ``*ForCausalLM``, unchanged. The same module trains on one device
    and under any par3d layout."""

    tp_plan = "auto"  # the transformers model's own plan
    pipeline_trunk = "model"  # under pp > 1, par3d splits the transformers model into stages ...
    pipeline_loss = "loss_fn"  # ... and applies this loss on the last stage

    def __init__(
        self,
        architecture: str = "llama",
        pretrained_path: str | None = None,
        vocab_size: int = 256,
        block_size: int = 64,
        hidden_size: int = 128,
        intermediate_size: int = 256,
        num_hidden_layers: int = 4,
        num_attention_heads: int = 4,
        num_key_value_heads: int = 2,
        tie_word_embeddings: bool = False,
        config_overrides: dict[str, Any] | None = None,
        lora: dict[str, Any] | None = None,
        adapter_path: str | None = None,
        own_loss: bool = False,
        lr: float = 3e-3,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model: nn.Module | None = None
        self.perplexity = Perplexity(ignore_index=-100)  # -100: a padding position's label (padded fine-tuning)
        self.tokens = SumMetric()

    def model_config(self) -> Any:
        """The transformers config: the pretrained directory's, or a fresh one of ``architecture``."""
        from transformers import AutoConfig

        hp = self.hparams
        if hp.pretrained_path:
            return AutoConfig.from_pretrained(hp.pretrained_path, **(hp.config_overrides or {}))
        return AutoConfig.for_model(
            hp.architecture,
            vocab_size=hp.vocab_size,
            max_position_embeddings=hp.block_size,
            hidden_size=hp.hidden_size,
            intermediate_size=hp.intermediate_size,
            num_hidden_layers=hp.num_hidden_layers,
            num_attention_heads=hp.num_attention_heads,
            num_key_value_heads=hp.num_key_value_heads,
            tie_word_embeddings=hp.tie_word_embeddings,
            # The architecture's special token ids belong to its own vocabulary; the byte-level data has none.
            **{"bos_token_id": None, "eos_token_id": None, "pad_token_id": None, **(hp.config_overrides or {})},
        )

    def configure_model(self) -> None:
        from transformers import AutoModelForCausalLM

        if self.model is not None:  # idempotent: Lightning may call it again, e.g. for trainer.validate
            return
        if self.hparams.pretrained_path and not getattr(self._trainer_strategy(), "loads_pretrained", False):
            # One device, or a strategy that does not read the weights itself: transformers loads them.
            # from_pretrained returns the model in eval mode; training starts in train mode (dropout where the
            # config has it), as with from_config and with par3d's init="pretrained".
            self.model = AutoModelForCausalLM.from_pretrained(self.hparams.pretrained_path).train()
        else:  # par3d with init="pretrained" reads each rank's shards of the weights into the built model
            self.model = AutoModelForCausalLM.from_config(self.model_config())
        if self.hparams.lora or self.hparams.adapter_path:  # LoRA adapters: the base frozen, the adapters trained
            self.model = self._adapted(self.model)

    def _adapted(self, base: nn.Module) -> nn.Module:
        """``base`` with LoRA adapters: fresh ones of ``lora``'s config, or those saved in ``adapter_path`` (peft's
        ``save_pretrained``), which par3d's ``init="pretrained"`` reads into each rank's slices itself."""
        import warnings

        from peft import LoraConfig, PeftModel, get_peft_model

        path = self.hparams.adapter_path
        with warnings.catch_warnings():  # peft 0.21 asks transformers 5 a deprecated question; nothing to act on
            warnings.filterwarnings(
                "ignore", message=".*is_gradient_checkpointing.* is deprecated", category=FutureWarning
            )
            if not path:
                return get_peft_model(base, LoraConfig(**_plain(self.hparams.lora)))
            if getattr(self._trainer_strategy(), "loads_pretrained", False):
                config = LoraConfig.from_pretrained(path)
                config.inference_mode = False  # saved for inference; trained on here
                return get_peft_model(base, config)
            return PeftModel.from_pretrained(base, path, is_trainable=True)

    def _trainer_strategy(self) -> Any:
        return self._trainer.strategy if self._trainer is not None else None

    def forward(self, idx: torch.Tensor) -> Any:
        assert self.model is not None
        return logits_of(self.model(idx))  # (B, T, vocab) logits

    def loss_fn(self, logits: Any, targets: torch.Tensor) -> torch.Tensor:
        logits = logits_of(logits)
        if not self.training:  # validation and test: the metrics see every token once
            self.perplexity.update(logits, targets)
            self.tokens.update((targets != -100).sum())
        # (B·T, vocab) against (B·T,): the mean over the tokens whose label is not -100
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        if self.hparams.own_loss:  # the model's own labels= loss (the ids: it shifts them), its router's loss included
            assert self.model is not None
            output = self.model(input_ids=x, labels=x)
            if getattr(output, "aux_loss", None) is not None:
                self.log("train_router_loss", output.aux_loss, sync_dist=True)
            self.log("train_loss", output.loss, prog_bar=True, sync_dist=True)
            return output.loss
        loss = self.loss_fn(self(x), y)
        # sync_dist: the data-parallel mean, which under par3d's loss_mean="tokens" is the global batch's token mean
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = self.loss_fn(self(x), y)
        self.log("val_loss", loss, prog_bar=True, sync_dist=True)
        self.log("val_ppl", self.perplexity, prog_bar=True)
        self.log("val_tokens", self.tokens)
        return loss

    def predict_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> Any:
        return self(batch[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        hp = self.hparams
        trained = [p for p in self.parameters() if p.requires_grad]  # with LoRA: the adapters only
        return torch.optim.AdamW(trained, lr=hp.lr, weight_decay=hp.weight_decay, betas=tuple(hp.betas), eps=hp.eps)
