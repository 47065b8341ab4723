"""Reference data: a synthetic Markov corpus with a known loss floor, text files, classification."""
from lightning_par.data.markov import MarkovSource
from lightning_par.data.modules import NextTokenDataset, SyntheticClassification, SyntheticCorpus, TextFile

__all__ = ["MarkovSource", "NextTokenDataset", "SyntheticClassification", "SyntheticCorpus", "TextFile"]
