"""Real storage, one operation at a time, for the meta tensors of a meta-built module while the setup trace runs it.

[Note: tracing a meta-built module]
The setup trace ([Note: block flow] in flow.py) runs the user's step once while every rank still holds the
whole module. A meta-built module has no storage for its parameters, and running the step on the meta device
fails wherever code outside torch's kernels needs a value: Hugging Face's masks call ``.all()`` on the position
ids when no cache object exists (``use_cache=False``), MoE layers pick the experts that received tokens with
``nonzero()``, a user's step branches on ``if mask.any():``. So the trace runs on the rank's real device with
the real batch (position ids, masks, labels: every value computed from the data is the one a device computes),
and every meta tensor an operation takes is replaced, for that operation only, by a zero-filled tensor of its
shape, dtype and strides (a *stand-in*); ``.device`` of a meta tensor answers the real device, so what user code
creates "on the weights' device" is real too. Why this rather than reading the ends and one block at a time from
``weights=``:

- memory: a stand-in lives as long as the operation's result refers to it, so a rank holds at most the
  operands of one operation at once (measured: ``peak_bytes``, at most the largest parameter's bytes on the
  tests' models, less than any rank's share), never a whole block stack, and reads nothing of the file;
- the same trace on every rank: zeros are the same everywhere (empty storage is not), so every rank takes the
  same branches and learns the same flow, and no collective waits for a rank that learned another one; zero
  weights keep every value finite (norms of zeros are zeros, a softmax of zeros is uniform), which
  uninitialized memory does not;
- MoE and data-dependent blocks run too: the blocks compute on real (zero-weight) values, which a shape-only
  run of a block on the meta device cannot (``nonzero()`` has no meta result).

What it cannot give is a value computed from the weights: code that refuses zero activations (``if
(x == 0).all(): raise``) fails in the trace, and the error names its line ([Note: the line that failed] in
flow.py) with the workaround (build the module with real weights). A plainly built module is traced as it is.
"""
from __future__ import annotations

import weakref

import torch
from torch.overrides import TorchFunctionMode

from lightning_par._compat import tree_map

_DEVICE_GET = torch.Tensor.device.__get__


class StandIns(TorchFunctionMode):
    """While active, each torch operation gets a zero-filled real tensor on ``device`` for every meta tensor it
    takes (see [Note: tracing a meta-built module]); ``peak_bytes``: the most stand-in bytes alive at once."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.device = device
        self.live = self.peak_bytes = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", None) == "__get__":  # a tensor's attribute: metadata, no storage needed
            if func == _DEVICE_GET and args and args[0].is_meta:
                return self.device
            return func(*args, **kwargs)
        made: dict[int, torch.Tensor] = {}  # one stand-in per meta tensor of this operation

        def real(x):
            if isinstance(x, torch.Tensor) and x.is_meta:
                if id(x) not in made:
                    made[id(x)] = self._stand_in(x)
                return made[id(x)]
            return x
        args, kwargs = tree_map(real, (args, kwargs))
        return func(*args, **kwargs)

    def _stand_in(self, x: torch.Tensor) -> torch.Tensor:
        t = torch.zeros_like(x, device=self.device)
        nbytes = t.untyped_storage().nbytes()
        self.live += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live)
        weakref.finalize(t, self._free, nbytes)  # runs once no view of it is left
        return t

    def _free(self, nbytes: int) -> None:
        self.live -= nbytes
