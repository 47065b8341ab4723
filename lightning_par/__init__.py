"""lightning_par: data, pipeline and tensor parallel Lightning strategies for unchanged LightningModules."""
__version__ = "0.1.0"
