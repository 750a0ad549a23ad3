"""One parallelism (or one change to the model) per module: tensor parallelism (``tensor_parallel``, ``tp_styles``,
``tp_local_styles``, ``tp_sequence_styles``, ``lora_plan``, ``packed_shards``, ``ties``), data parallelism
(``data_parallel``, ``compression``), activation checkpointing, ``torch.compile`` per block (``compile``), precision
policies, the optimizer paths, and the shards' materialization (``materialize``, ``metric_state``).
:mod:`lightning_par3d.compose` applies them in order."""
