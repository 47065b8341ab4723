"""Lightning's precision plugin, specialised for a layout by subclassing it, installed in setup and taken out
at teardown.

[Note: precision subclasses]
A layout changes three things of the plugin Lightning built (or the user passed): gradient clipping by norm
(the norm over pipeline stages and tensor shards, not this rank's), clipping by value (DTensor and plain
gradients in separate calls), and, under 16-mixed, what happens after the closure (one overflow anywhere
skips the step everywhere) and how the ``GradScaler`` unscales (DTensor and plain gradients apart). Instead
of patching methods onto the user's plugin, the strategy installs a copy of it whose class is a subclass of
the plugin's own class (:func:`layout_precision`; a subclass per plugin class, made once) and gives the
original back at teardown, so the user's plugin and scaler objects leave the run as they came.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from lightning_par.tensor.mixed import split_unscale_scaler, subclass_copy


@dataclass
class PrecisionHooks:
    """What a layout does instead of the plugin's own: each takes ``(optimizer, value)`` / ``(optimizer)``."""

    clip_by_norm: Optional[Callable] = None
    clip_by_value: Optional[Callable] = None
    before_optimizer_hooks: Optional[Callable] = None  # 16-mixed: runs first in ``_after_closure``
    split_unscale: bool = False  # the scaler unscales DTensor and plain gradients in separate calls


_SUBCLASSES: dict[type, type] = {}


def _layout_class(base: type) -> type:
    if base not in _SUBCLASSES:
        class LayoutPrecision(base):  # type: ignore[misc, valid-type]
            _lp_hooks: PrecisionHooks

            def clip_grad_by_norm(self, optimizer, clip_val) -> None:
                if self._lp_hooks.clip_by_norm is None:
                    return super().clip_grad_by_norm(optimizer, clip_val)
                self._lp_hooks.clip_by_norm(optimizer, clip_val)

            def clip_grad_by_value(self, optimizer, clip_val) -> None:
                if self._lp_hooks.clip_by_value is None:
                    return super().clip_grad_by_value(optimizer, clip_val)
                self._lp_hooks.clip_by_value(optimizer, clip_val)

            def _after_closure(self, model, optimizer) -> None:
                if self._lp_hooks.before_optimizer_hooks is not None:
                    self._lp_hooks.before_optimizer_hooks(optimizer)
                super()._after_closure(model, optimizer)

        LayoutPrecision.__name__ = LayoutPrecision.__qualname__ = f"Layout{base.__name__}"
        _SUBCLASSES[base] = LayoutPrecision
    return _SUBCLASSES[base]


def layout_precision(plugin, hooks: PrecisionHooks):
    """A copy of ``plugin`` (sharing its state) whose class overrides what ``hooks`` give; its scaler, if any
    and if ``hooks.split_unscale``, a subclass copy too (see [Note: precision subclasses])."""
    new = subclass_copy(plugin, _layout_class(type(plugin)))
    new._lp_hooks = hooks
    if hooks.split_unscale and getattr(plugin, "scaler", None) is not None:
        new.scaler = split_unscale_scaler(plugin.scaler)
    return new
