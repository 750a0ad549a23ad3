"""The engine: everything a front-end needs to train one model at a par3d layout, in one framework-free object.

A front-end (the Lightning Trainer strategy, the Fabric strategy, the Accelerate ``Accelerator``, or a plain torch
loop) maps its framework's hooks onto these calls, in this order::

    engine = Par3DEngine(Par3DConfig(dp_shard=2, tp=2), precision="32-true")
    engine.resolve(world_size=4, device_type="cpu")   # before any process group: every check that can fail early
    engine.setup(torch.device("cpu"))                  # the default group (if nobody made it) and the mesh
    with engine.init_context():                        # real on rank 0, meta elsewhere (init="rank0")
        model = build_model()
    model = engine.parallelize(model)                  # TP, activation checkpointing, FSDP2/DDP, pipeline split
    [optimizer] = engine.setup_optimizers([torch.optim.AdamW(model.parameters())])   # ZeRO-1/2 wrapper if set
    for x, y in batches:                               # the sampler reads engine.dp_rank of engine.dp_size
        loss = engine.train_step(model, x, y, loss_fn)     # forward + backward, through the pipeline under pp
        engine.clip_grad_norm_(optimizer, 1.0)             # the norm over every tp, dp and pp shard
        optimizer.step(); optimizer.zero_grad()
    engine.save(path, {"step": step}, [engine.optimizer_state(optimizer)])   # DCP; optimizer_0, optimizer_1, …
    engine.teardown()                                  # closes hooks; the mesh stays for the next run

With ``Par3DConfig(layout="auto")`` the layout is chosen at launch: ``resolve`` checks what it can and ``setup``
joins the default group but builds no mesh; :meth:`choose_layout` (every rank, with the model and the batch's
shape) plans, and builds the mesh of the layout it chose.

Each job of the engine is a module of this package (the table in :mod:`lightning_par3d.engine.engine`).

A model parallelized once stays parallelized: :meth:`parallelize` called again with the same module (Lightning's
``fit`` then ``test``, a second ``fit``, a new engine in the same process) reuses it, and refuses it with a clear
error if the layout differs. One mesh per layout serves every run of that layout in the process
(:mod:`lightning_par3d.distributed.groups`).
"""

from lightning_par3d.engine.collectives import reduce_op_name
from lightning_par3d.engine.engine import LossFn, Par3DEngine
from lightning_par3d.engine.saving import MODEL_KEY, optimizer_key

__all__ = ["MODEL_KEY", "LossFn", "Par3DEngine", "optimizer_key", "reduce_op_name"]
