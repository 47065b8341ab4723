"""Streaming weights into each rank's share: a safetensors file, a Hugging Face sharded safetensors
directory, a torch state-dict file, a Lightning ``.ckpt`` or a ``torch.distributed.checkpoint`` directory,
listed without reading, checked against the module before reading, and read one tensor (one box of it)
at a time into tensors that already exist. Knows nothing of Lightning.

Example (a rank that holds rows 4-7 of a Shard(0) weight of 8 rows, 2 ranks)::

    reader = open_weights("llama/", prefix="net.")                  # model.safetensors.index.json inside
    reader.check(expected_state(meta_module))                       # ValueError listing every difference
    reader.read_into("net.lm_head.weight", local_rows,
                     shard_region((8, 16), [Shard(0)], mesh_shape=(2,), coordinate=(1,)))
    reader.bytes_read                                               # 4 rows x 16 x 4 bytes = 256
"""
from lightning_par.weights.reader import WeightsMatch, WeightsReader, expected_state, open_weights
from lightning_par.weights.regions import as_region, dtensor_region, region_slices, shard_region, split_region
from lightning_par.weights.sources import DCPSource, SafetensorsSource, Source, TensorInfo, TorchFileSource, open_source

__all__ = ["DCPSource", "SafetensorsSource", "Source", "TensorInfo", "TorchFileSource", "WeightsMatch",
           "WeightsReader", "as_region", "dtensor_region", "expected_state", "open_source", "open_weights",
           "region_slices", "shard_region", "split_region"]
