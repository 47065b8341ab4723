"""Registration of our strategies by their own names only."""
from __future__ import annotations


class RegisteredByName:
    """Mixin: ``register_strategies`` registers ``strategy_name`` with ``strategy_description`` and none of
    the parent strategy's names (Lightning's ``DDPStrategy`` would register ``ddp_*`` variants again)."""

    strategy_name: str
    strategy_description: str

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        if cls.strategy_name not in strategy_registry:
            strategy_registry.register(cls.strategy_name, cls, description=cls.strategy_description)
