"""Train the bundled GPT with par3d from Lightning's own command line (LightningCLI), with no Hydra.

    python examples/cli.py fit --trainer.strategy=lightning_par3d.Par3DStrategy --trainer.strategy.tp=2 \\
        --trainer.devices=2 --trainer.accelerator=cpu
    python examples/cli.py fit --config conf/cli/par3d_tp2.yaml                 # the same from a YAML file
    python examples/cli.py fit --config conf/cli/par3d_tp2.yaml --model.n_layer=2
    python examples/cli.py fit --trainer.strategy=lightning_par3d.Par3DStrategy --trainer.strategy.help Par3DStrategy

Every ``Par3DConfig`` field is a typed argument of ``Par3DStrategy``, so ``--trainer.strategy.<field>=`` and
``init_args`` take all of them, checked. The model, data and trainer defaults are the Hydra app's
(``conf/model/gpt.yaml``, ``conf/data/shakespeare.yaml``, ``conf/trainer/cpu.yaml``, ``seed: 1234``).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, so that `examples.*` imports

from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

import lightning_par3d  # noqa: F401  (registers "par3d")
from examples.data import ShakespeareDataModule
from examples.gpt import GPTModule
from lightning_par3d import quiet_known_upstream_warnings

quiet_known_upstream_warnings()  # Lightning's known noise (docs/api.md, "The console")

TRAINER_DEFAULTS = {
    "max_steps": 200,
    "val_check_interval": 50,  # training batches, counted across epochs: every layout's epoch may be shorter
    "check_val_every_n_epoch": None,
    "limit_val_batches": 8,
    "num_sanity_val_steps": 0,
    "log_every_n_steps": 10,
}


class GPTCLI(LightningCLI):
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.set_defaults({"model.n_layer": 4, "model.n_embd": 128})
        parser.link_arguments("model.block_size", "data.block_size")


def main() -> None:
    GPTCLI(GPTModule, ShakespeareDataModule, trainer_defaults=TRAINER_DEFAULTS, seed_everything_default=1234)


if __name__ == "__main__":
    main()
