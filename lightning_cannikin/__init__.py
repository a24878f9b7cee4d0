"""lightning-cannikin: heterogeneity-aware data-parallel training for PyTorch Lightning.

Importing the package registers ``strategy="cannikin"`` (and ``cannikin_spawn``, ``cannikin_fork``,
``cannikin_notebook``) in Lightning's strategy registry.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_cannikin.__about__ import __version__
from lightning_cannikin.core.plan import Plan
from lightning_cannikin.training.callback import Cannikin
from lightning_cannikin.training.emulator import EmulatedCluster
from lightning_cannikin.training.strategy import CannikinStrategy

CannikinStrategy.register_strategies(StrategyRegistry)

__all__ = ["Cannikin", "CannikinStrategy", "EmulatedCluster", "Plan", "__version__"]
