"""Where each parallelism is applied: the mesh (``mesh``, ``groups``), tensor parallelism (``tensor_parallel``,
``styles``), data parallelism (``data_parallel``, ``compression``), activation checkpointing, materialization of
the shards, precision policies, gradient norms, and ``parallelize``, which composes them in a fixed order."""
