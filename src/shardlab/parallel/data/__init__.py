"""Data parallelism and its family: every rank holds the model (or, under ZeRO-3, a shard of every
parameter) and takes its slice of the batch.

    replicate.py   DataParallel: gradients averaged (blocking, bucketed, or overlapped with backward)
    buckets.py     gradients packed into flat buckets, one collective per bucket
    grad_hooks.py  the gradient-hook engine every wrapper reduces through during backward
    zero.py        ZeRO-1/2: optimizer state (and gradients) sharded over the replicas
    fsdp*.py       ZeRO-3 / FSDP: parameters sharded too, gathered per unit for forward and backward
    sync_guard.py  a torch optimizer's step over gradients not yet synchronised is refused
    syncbn.py      batch-norm statistics over the replicas

parallel/replicas.py chooses among these engines (layout.zero), for experts and pipeline stages too.
"""
