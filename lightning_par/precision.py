"""``trainer.precision`` → the ``Trainer`` arguments that give the user exactly that precision.

[Note: 16-mixed on CPU]
Lightning silently turns ``precision="16-mixed"`` into bf16 autocast on CPU. torch's CPU autocast does
support float16, and ``torch.amp.GradScaler("cpu")`` works, so on CPU the app passes
``MixedPrecision("16-mixed", "cpu", GradScaler("cpu"))`` as a plugin (and no ``precision=``, which
Lightning would refuse next to a precision plugin): the run really computes in float16 with loss scaling.
"""
from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.plugins.precision import MixedPrecision

PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true")


def resolve_accelerator(accelerator: str) -> str:
    """``"auto"`` → ``"cuda"`` when a CUDA device is visible, else ``"cpu"``; other names lower-cased as given."""
    name = str(accelerator).lower()
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return "cuda" if name == "gpu" else name


def precision_kwargs(precision: str, accelerator: str) -> dict[str, Any]:
    """``Trainer`` keyword arguments for ``precision`` on ``accelerator`` (see [Note: 16-mixed on CPU]).

    Example::

        >>> precision_kwargs("bf16-mixed", "cpu")
        {'precision': 'bf16-mixed'}
        >>> kw = precision_kwargs("16-mixed", "cpu"); kw["plugins"][0].scaler is not None
        True
    """
    precision = str(precision)
    if precision not in PRECISIONS:
        raise ValueError(
            f"trainer.precision={precision!r} is not supported; choose one of {', '.join(PRECISIONS)} "
            f"(e.g. `trainer.precision=bf16-mixed`)."
        )
    if precision == "16-mixed" and resolve_accelerator(accelerator) == "cpu":
        return {"plugins": [MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))]}
    return {"precision": precision}
