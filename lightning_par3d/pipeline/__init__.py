"""Pipeline parallelism on ``torch.distributed.pipelining``: the split of a trunk into stages (``split``), the
transformers decoders' stages (``transformers_stages``), and the runner that drives torch's schedule for one batch
(``runner``)."""
