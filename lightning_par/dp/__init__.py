"""Data-parallel building blocks: DDP communication hooks, ZeRO-1 sharding, learning-rate scaling."""
