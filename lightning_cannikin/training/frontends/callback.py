"""``Cannikin``: the callback users hold, with the decisions that are theirs; the engine's settings are one object.

It is :class:`~lightning_cannikin.training.frontends.lightning_hooks.BalancingCallback` (Lightning's hooks wired to the
:class:`~lightning_cannikin.training.engine.BalancingEngine`) with the user's arguments, which the strategy builds
its engine from.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lightning_cannikin.training.frontends.lightning_hooks import BalancingCallback
from lightning_cannikin.training.settings import CannikinSettings, EngineOptions

__all__ = ["Cannikin"]


class Cannikin(BalancingCallback):
    """Balance a heterogeneous cluster and, optionally, adapt the total batch size for goodput.

    Args:
        max_batch_size: the largest total batch (per optimizer step) to consider. ``None`` keeps the total batch
            fixed and only balances its split.
        local_batch_bounds: bounds on any rank's local batch: an upper bound, or ``(lower, upper)`` with scalars or
            per-rank sequences. ``None``: at least one sample, no cap.
        lr_scaling: how the learning rate follows the total batch: ``"adascale"`` (the AdaScale gain; its square root
            for Adam-family optimizers), ``"sqrt"``, ``"linear"`` or ``"none"``.
        base_batch_size: the total batch the learning rate was tuned for (default: the initial total batch).
        balance: split unevenly by measured speed; ``False`` keeps an even split (an AdaptDL-like baseline when
            combined with ``max_batch_size``).
        replan_every_n_steps: also re-plan the split mid-epoch every this many training steps (``None``: while
            warming up and at epoch ends only).
        save_profile: at each re-plan, rank zero writes ``cannikin_profile.json`` into the first logger's folder for
            this run (``version_N`` of TensorBoard and CSV, ``save_dir/name/version`` of W&B and MLflow), for
            ``cannikin plan`` and ``cannikin report``. Nothing is written without a logger.
        settings: the engine's tuning settings (:class:`~lightning_cannikin.CannikinSettings`: warm-up, recency,
            hysteresis, noise measurement cadence, accumulation, mid-epoch adaptation).

    Example::

        trainer = Trainer(strategy="cannikin", devices=4, callbacks=[Cannikin(max_batch_size=4096)])

    """

    def __init__(
        self,
        max_batch_size: int | None = None,
        local_batch_bounds: int | tuple[int | Sequence[int], int | Sequence[int] | None] | None = None,
        lr_scaling: str = "adascale",
        base_batch_size: int | None = None,
        balance: bool = True,
        replan_every_n_steps: int | None = None,
        *,
        save_profile: bool = True,
        settings: CannikinSettings | None = None,
    ) -> None:
        every = replan_every_n_steps
        choices = (max_batch_size, local_batch_bounds, lr_scaling, base_batch_size, balance, every, save_profile)
        super().__init__(EngineOptions(*choices, settings))  # type: ignore[arg-type]

    @property
    def settings(self) -> CannikinSettings:
        """The engine's tuning settings."""
        return self.options.settings

    @property
    def max_batch_size(self) -> int | None:
        return self.options.max_batch_size

    @property
    def local_batch_bounds(self) -> Any:
        return self.options.local_batch_bounds

    @property
    def lr_scaling(self) -> str:
        return self.options.lr_scaling

    @property
    def base_batch_size(self) -> int | None:
        return self.options.base_batch_size

    @property
    def balance(self) -> bool:
        return self.options.balance

    @property
    def replan_every_n_steps(self) -> int | None:
        return self.options.replan_every_n_steps

    @property
    def save_profile(self) -> bool:
        return self.options.save_profile
