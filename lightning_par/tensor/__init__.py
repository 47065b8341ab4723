"""Tensor parallelism building blocks: plans (auto, Hugging Face, user globs), applying them with DTensor,
attention sharding rules, and helpers for models mixing DTensor and plain parameters."""
from lightning_par.tensor.plan import TensorPlan, build_plan

__all__ = ["TensorPlan", "build_plan"]
