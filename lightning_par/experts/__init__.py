"""Expert parallelism: routed experts divided whole over ranks, tokens sent to them by all-to-all
(:mod:`~lightning_par.experts.apply`; containers found by :mod:`~lightning_par.experts.discovery`)."""
from lightning_par.experts.apply import (ExpertParallel, apply_expert_parallel, apply_experts, check_expert_layout,
                                         is_expert_parameter)
from lightning_par.experts.discovery import ExpertContainer, find_experts

__all__ = ["ExpertContainer", "ExpertParallel", "apply_expert_parallel", "apply_experts", "check_expert_layout",
           "find_experts",
           "is_expert_parameter"]
