"""``python -m lightning_par3d.planning``: the same command line as ``python -m lightning_par3d.plan``."""

from lightning_par3d.planning.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
