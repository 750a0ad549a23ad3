"""``python -m lightning_par3d <command>``: the ``par3d`` command (:mod:`lightning_par3d.tools.cli`)."""

from lightning_par3d.tools.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
