"""The optimizer's middle layer: DistributedOptimizer (facade), route table, step engine, error feedback, offload worker, component state, fusion planning, step statistics, DDP hook."""
