"""A module built without memory for its parameters, given storage rank by rank: each rank materializes
on its device only the parameters and buffers it owns, initializes them as the module's own code would
(``reset_parameters()``, a Hugging Face model's ``_init_weights``), or reads them from a weights file,
one owned share at a time. Knows nothing of Lightning; the strategies call it from their hooks.

Example (one process; a pipeline stage or a tensor shard passes ``owned=``)::

    with meta_parameters():                          # parameters on the meta device, buffers real
        model = MyModule()
    made = materialize(model, torch.device("cpu"))   # {name: tensor}: sentinel-filled storage
    left = initialize(model, made, seed=1234)        # names no init wrote (refuse them, or read them)
    reader = open_module_weights("model.safetensors", model)
    read_weights(model, reader)                      # every owned tensor (each rank: its own share)
"""
from lightning_par.materialize.init import initialize, materialize, move_real, sentinel_left
from lightning_par.materialize.load import assign_state, module_ties, open_module_weights, read_weights, weight_targets
from lightning_par.materialize.meta import free_parameters, has_meta, is_meta, meta_names, meta_parameters, release

__all__ = ["assign_state", "free_parameters", "has_meta", "initialize", "is_meta", "materialize", "meta_names",
           "meta_parameters", "module_ties", "move_real", "open_module_weights", "read_weights", "release",
           "sentinel_left", "weight_targets"]
