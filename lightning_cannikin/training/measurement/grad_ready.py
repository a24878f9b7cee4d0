"""When this rank's gradients are ready, from parameter hooks: the timing source when DDP reduces them in C++.

With no Python comm hook, DDP's own all-reduce runs with no Python per bucket, and nothing else marks when the
gradients reach it. A post-accumulate-grad hook runs right after a parameter's gradient is accumulated, on the
autograd thread (on CUDA the step timer records an event on the current stream there, behind that gradient's
kernels). The first backward hooks every parameter and learns the order in which their gradients become ready; from
then on two parameters stay hooked: the first one ready (gradient production starts, DDP's first bucket starts to
fill) and the last one (this rank's backward compute ends, whatever the all-reduce does next). Two Python calls a
step, whatever the model's size.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

__all__ = ["GradientReadiness"]


class GradientReadiness:
    """Calls ``on_ready`` when the first and when the last gradient of each backward is ready.

    Args:
        parameters: the model's parameters (those that do not require a gradient are left alone).
        on_ready: called with no argument each time a hooked parameter's gradient is accumulated (the step timer's
            :meth:`~lightning_cannikin.training.measurement.step_timer.StepTimer.gradient_ready`).

    """

    def __init__(self, parameters: Iterable[torch.nn.Parameter], on_ready: Callable[[], None]) -> None:
        trainable = [p for p in parameters if p.requires_grad]
        self._on_ready = on_ready
        self._order: list[int] = []  # parameter indices in the order their gradients became ready (discovery)
        self._handles: dict[int, Any] = {
            index: p.register_post_accumulate_grad_hook(self._discovering(index)) for index, p in enumerate(trainable)
        }
        self.discovered = False

    def backward_done(self) -> None:
        """A backward ended: after the first one that produced gradients, keep only the first and last ready hooked."""
        if self.discovered or not self._order:
            return
        keep = {self._order[0], self._order[-1]}
        for index in [i for i in self._handles if i not in keep]:
            self._handles.pop(index).remove()
        self._order = []
        self.discovered = True

    def remove(self) -> None:
        """Remove every hook (the strategy's teardown)."""
        for handle in self._handles.values():
            handle.remove()
        self._handles = {}

    def _discovering(self, index: int) -> Callable[[torch.Tensor], None]:
        def hook(parameter: torch.Tensor) -> None:
            if not self.discovered:  # the two hooks kept after discovery only call on_ready
                self._order.append(index)
            self._on_ready()

        return hook
