"""The ``par3d`` command (``cli``) and its subcommands: ``plan``, ``dry-run`` (``dry_run_command`` over the
``dry_run`` function), ``smoke`` and ``export-hf``; ``loading`` is what they share (arguments, models, data)."""
