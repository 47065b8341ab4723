"""Reference workloads: modules written as users write them, knowing nothing of lightning_par."""
from lightning_par.models.gpt import GPT
from lightning_par.models.hf import HFCausalLM
from lightning_par.models.mlp import MLPClassifier

__all__ = ["GPT", "HFCausalLM", "MLPClassifier"]
