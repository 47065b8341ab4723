"""lightning_par: data, pipeline and tensor parallel Lightning strategies for unchanged LightningModules.

Importing the package registers the strategies' names with Lightning, so
``Trainer(strategy="data_parallel" | "pipeline_parallel" | "tensor_parallel" | "hybrid_parallel")`` works.
"""
from lightning.pytorch.strategies import StrategyRegistry as _StrategyRegistry

from lightning_par.strategies import (DataParallelStrategy, HybridParallelStrategy, PipelineParallelStrategy,
                                      TensorParallelStrategy)

__version__ = "0.1.0"
__all__ = ["DataParallelStrategy", "HybridParallelStrategy", "PipelineParallelStrategy", "TensorParallelStrategy"]

for _strategy in (DataParallelStrategy, HybridParallelStrategy, PipelineParallelStrategy, TensorParallelStrategy):
    _strategy.register_strategies(_StrategyRegistry)
del _strategy
