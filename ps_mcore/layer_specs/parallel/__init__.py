"""Model parallelism for tree batches: context parallelism (``cp_layout``: one rank's rows;
``cp_collectives``; ``context_parallel``: attention and outputs; ``cp_logprobs``) and
``pipeline`` (every rank runs the same plan)."""
