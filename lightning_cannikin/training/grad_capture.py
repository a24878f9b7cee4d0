"""This rank's local gradient, captured before DDP's own C++ all-reduce replaces it: the noise statistics' input.

The noise statistics need each rank's gradient before the reduction and the reduced one after. Through the Python
comm hook they see every bucket; DDP's own all-reduce has no Python seam. A post-accumulate-grad hook runs when a
parameter's gradient is accumulated, before DDP's reducer copies it into its bucket, so on a measured step every
parameter carries a hook that copies its local gradient into one flat buffer, in parameter order. After backward the
buffer reads like a single bucket to the :class:`~lightning_cannikin.training.grad_stats.GradientNormObserver`, and
on rank zero it is refilled with the reduced gradients in one fused copy.

The hooks exist only during measured backwards (registered before, removed after), so an unmeasured step costs
nothing; a measured one costs one copy per parameter and a buffer the size of the gradients (float32), kept for the
fit.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from lightning_cannikin.training.comm_hook import BucketObserver, WeightedAllReduceState

__all__ = ["GradientCapture"]


class GradientCapture:
    """A flat copy of the model's gradients, filled by parameter hooks during one backward.

    Args:
        parameters: the model's parameters (those that do not require a gradient are left out).

    """

    def __init__(self, parameters: Iterable[torch.nn.Parameter]) -> None:
        self._parameters = [p for p in parameters if p.requires_grad]
        self._flat: torch.Tensor | None = None
        self._views: list[torch.Tensor] = []
        self._handles: list[Any] = []

    @property
    def armed(self) -> bool:
        """Whether the hooks are in place (between :meth:`arm` and :meth:`disarm`)."""
        return bool(self._handles)

    def arm(self) -> None:
        """Hook every parameter for the next backward; a parameter without a gradient in it reads as zeros."""
        if self._flat is None:
            numel = sum(p.numel() for p in self._parameters)
            device = self._parameters[0].device if self._parameters else None
            self._flat = torch.empty(numel, dtype=torch.float32, device=device)
            self._views = list(torch.split(self._flat, [p.numel() for p in self._parameters]))
        self._flat.zero_()
        self._handles = [
            p.register_post_accumulate_grad_hook(self._copier(view))
            for p, view in zip(self._parameters, self._views, strict=True)
        ]

    def disarm(self) -> None:
        """Remove the hooks (after the backward, or at teardown)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def load_gradients(self) -> None:
        """Refill the buffer with the parameters' gradients as they are now (after the reduction), in one fused
        copy."""
        assert self._flat is not None
        pairs = zip(self._parameters, self._views, strict=True)
        with_grad = [(view, p.grad) for p, view in pairs if p.grad is not None]
        if len(with_grad) < len(self._views):
            self._flat.zero_()
        if with_grad:
            torch._foreach_copy_([view for view, _ in with_grad], [g.detach().reshape(-1) for _, g in with_grad])

    def report(self, observer: BucketObserver, state: WeightedAllReduceState, reduced: bool) -> None:
        """Show ``observer`` what the comm hook would have: the captured local gradient as one bucket before its
        reduction and, when ``reduced``, the reduced gradients after it."""
        assert self._flat is not None
        bucket = CapturedBucket(self._flat, self._parameters)
        observer.before_reduce(state, bucket)  # type: ignore[arg-type]  # reads what a GradBucket offers
        if reduced:
            self.load_gradients()
            observer.after_reduce(state, bucket, self._flat)  # type: ignore[arg-type]

    @staticmethod
    def _copier(view: torch.Tensor) -> Any:
        def copy(parameter: torch.Tensor) -> None:
            view.copy_(parameter.grad.detach().reshape(-1))

        return copy


class CapturedBucket:
    """What the noise statistics read of a gradient bucket (``dist.GradBucket``'s ``buffer``, ``parameters`` and
    ``is_last``), for the whole captured gradient."""

    def __init__(self, flat: torch.Tensor, parameters: list[torch.nn.Parameter]) -> None:
        self._flat = flat
        self._parameters = parameters

    def buffer(self) -> torch.Tensor:
        return self._flat

    def parameters(self) -> list[torch.nn.Parameter]:
        return self._parameters

    def is_last(self) -> bool:
        return True
