"""``par3d consolidate``: a par3d checkpoint directory (any layout) → one file ``torch.load`` reads, offline (no
processes, no GPU), running nothing in the checkpoint.

    par3d consolidate outputs/<date>/<time>/checkpoints/last.ckpt --output_file last.pt

The file holds the model under ``state_dict`` (the key it was saved under: Fabric's own key, ``state_dict`` for
``Par3DAccelerator.save_state``'s ``par3d`` subdirectory), each optimizer under its key, and ``meta.pt``'s entries,
as Lightning's ``consolidate_checkpoint`` writes them. ``meta.pt`` is read with ``weights_only=True``; pass
``--no-weights-only`` only for a checkpoint you trust whose hyper-parameters hold other types.
"""

from __future__ import annotations

import argparse
import sys

from lightning_par3d.tools.loading import example_of


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="par3d consolidate",
        description=__doc__.split("\n\n")[0],
        epilog=example_of(__doc__) + "\n\n" + __doc__.split("\n\n")[2].strip(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("checkpoint", help="a par3d checkpoint directory (Trainer, Fabric or Accelerate)")
    parser.add_argument("--output_file", default=None, help="the file to write (default: <checkpoint>.consolidated)")
    parser.add_argument(
        "--no-weights-only", action="store_true", help="read meta.pt with weights_only=False (trusted checkpoints only)"
    )
    args = parser.parse_args(argv)
    from lightning_par3d.checkpoint.consolidate import consolidate

    try:
        out = consolidate(args.checkpoint, args.output_file, weights_only=not args.no_weights_only)
    except (ValueError, FileNotFoundError, FileExistsError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"wrote {out} (load it with torch.load({str(out)!r}))")
    return 0


if __name__ == "__main__":
    sys.exit(main())
