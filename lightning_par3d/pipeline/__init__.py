"""Pipeline parallelism on ``torch.distributed.pipelining``: the split of a trunk into stages (``split``), the
schedule names and stage placement (``schedules``), and the runner that drives torch's schedule for one batch
(``runner``)."""
