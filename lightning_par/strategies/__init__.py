"""One Lightning ``Strategy`` per module."""
from lightning_par.strategies.data_parallel import DataParallelStrategy
from lightning_par.strategies.hybrid_parallel import HybridParallelStrategy
from lightning_par.strategies.pipeline_parallel import PipelineParallelStrategy
from lightning_par.strategies.tensor_parallel import TensorParallelStrategy

__all__ = ["DataParallelStrategy", "HybridParallelStrategy", "PipelineParallelStrategy", "TensorParallelStrategy"]
