"""Data parallelism with replicated parameters: DDP with bucketed all-reduce overlapping
backward (:mod:`~plait.strategies.data_parallel.ddp`, its buckets and communication hooks),
the naive reference (:mod:`~plait.strategies.data_parallel.naive`), the threaded
single-process DataParallel (:mod:`~plait.strategies.data_parallel.threaded`) and the
gradient synchronisation they share (:mod:`~plait.strategies.data_parallel.grad_sync`)."""
