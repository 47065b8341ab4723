"""lightning_par: data, pipeline and tensor parallel Lightning strategies for unchanged LightningModules.

Importing the package registers the strategies' names with Lightning, so
``Trainer(strategy="data_parallel" | "pipeline_parallel" | "tensor_parallel")`` works.
"""
from lightning.pytorch.strategies import StrategyRegistry as _StrategyRegistry

from lightning_par.strategies import DataParallelStrategy, PipelineParallelStrategy, TensorParallelStrategy

__version__ = "0.1.0"
__all__ = ["DataParallelStrategy", "PipelineParallelStrategy", "TensorParallelStrategy"]

for _strategy in (DataParallelStrategy, PipelineParallelStrategy, TensorParallelStrategy):
    _strategy.register_strategies(_StrategyRegistry)
del _strategy
