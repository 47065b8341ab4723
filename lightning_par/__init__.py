"""lightning_par: data, pipeline and tensor parallel Lightning strategies for unchanged LightningModules."""
__version__ = "0.1.0"

from lightning.pytorch.strategies import StrategyRegistry as _StrategyRegistry

from lightning_par.strategies.data_parallel import DataParallelStrategy

DataParallelStrategy.register_strategies(_StrategyRegistry)

from lightning_par.strategies.tensor_parallel import TensorParallelStrategy  # noqa: E402

TensorParallelStrategy.register_strategies(_StrategyRegistry)

from lightning_par.strategies.pipeline_parallel import PipelineParallelStrategy  # noqa: E402

PipelineParallelStrategy.register_strategies(_StrategyRegistry)
