"""``par3d export-hf``: a par3d checkpoint of a Hugging Face transformers model → a ``save_pretrained`` directory,
offline (no processes, no GPU), from a checkpoint saved at any layout.

    par3d export-hf outputs/<date>/<time>/checkpoints/last.ckpt exported/ --config path/to/config_dir

``--config`` is a directory holding the model's ``config.json`` (the one the run started from). ``--key`` is the
checkpoint entry holding the model: ``state_dict`` for the Trainer (the default), the key you saved under for
Fabric (``"model"``), ``state_dict`` for ``Par3DAccelerator.save_state`` (in its ``par3d`` subdirectory).
"""

from __future__ import annotations

import argparse
import sys

from lightning_par3d.checkpoint.pretrained import convert_checkpoint
from lightning_par3d.tools.loading import example_of


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="par3d export-hf",
        description=__doc__.split("\n\n")[0],
        epilog=example_of(__doc__) + "\n\n" + __doc__.split("\n\n")[2].strip(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("checkpoint", help="a par3d checkpoint directory (Trainer, Fabric or Accelerate)")
    parser.add_argument("out", help="the save_pretrained directory to write")
    parser.add_argument("--config", required=True, help="a directory with the model's config.json")
    parser.add_argument("--key", default="state_dict", help="the checkpoint entry holding the model")
    args = parser.parse_args(argv)
    try:
        out = convert_checkpoint(args.checkpoint, args.config, args.out, args.key)
    except (ValueError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"wrote {out} (load it with AutoModelForCausalLM.from_pretrained({str(out)!r}))")
    return 0


if __name__ == "__main__":
    sys.exit(main())
