"""Learning-rate schedules that run on training progress instead of the step count.

A larger total batch takes fewer steps to cover the same ground, so a schedule written in steps of the base batch
(warm-up, cosine, step decay) runs late when Cannikin grows the batch. :attr:`Cannikin.progress` counts the base-batch
steps' worth of progress made (the sum of the AdaScale gains, one per optimizer step); :func:`progress_lr_lambda`
turns a schedule written in base-batch steps into an ``lr_lambda`` for :class:`torch.optim.lr_scheduler.LambdaLR`
that reads it. Without a Cannikin callback (plain DDP) every step is one base-batch step and the step count is used.

Example::

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        cosine = lambda progress: 0.5 * (1 + math.cos(math.pi * min(progress / 5000, 1.0)))
        scheduler = LambdaLR(optimizer, progress_lr_lambda(self.trainer, cosine))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

"""

from __future__ import annotations

from collections.abc import Callable

import lightning.pytorch as pl

from lightning_cannikin.training.frontends.lightning_hooks import BalancingCallback

__all__ = ["progress_lr_lambda"]


def progress_lr_lambda(trainer: pl.Trainer, schedule: Callable[[float], float]) -> Callable[[int], float]:
    """An ``lr_lambda`` for ``LambdaLR`` (``interval="step"``) that evaluates ``schedule`` at Cannikin's progress.

    Args:
        trainer: the Trainer (``self.trainer`` in ``configure_optimizers``); its Cannikin callback is looked up when
            the scheduler first asks, so the one ``strategy="cannikin"`` adds on its own is found too.
        schedule: the LR multiplier as a function of progress in base-batch steps.

    Cannikin counts a step's progress just before the optimizer steps, so the LR the scheduler sets after step ``k``
    is ``schedule`` at the progress of steps ``0..k``, the same on every rank.
    """

    def lr_lambda(step: int) -> float:
        cannikin = next((cb for cb in trainer.callbacks if isinstance(cb, BalancingCallback)), None)
        return float(schedule(cannikin.progress.value if cannikin is not None else float(step)))

    return lr_lambda
