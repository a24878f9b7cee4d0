"""This rank's local gradient, measured before DDP's own C++ all-reduce replaces it: the noise statistics' input.

The noise statistics need each rank's gradient before the reduction and the reduced one after. Through the Python
comm hook they see every bucket; DDP's own all-reduce has no Python seam. A post-accumulate-grad hook runs when a
parameter's gradient is accumulated, before DDP's reducer copies it into its bucket (and, at the end of backward,
the reduced values back over it), so on a measured step every parameter carries a hook that takes its local squared
norm there: one read of the gradient, no copy, no buffer. After backward the parameters hold the reduced gradients,
whose norm the observer takes in one fused pass.

The hooks exist only during measured backwards (registered before, removed after): an unmeasured step costs nothing.
On a measured step the norms run inside backward, so that step's measured compute time carries them (one norm per
parameter; on CUDA, kernels on the stream).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from lightning_cannikin.training.grad_norms import GradientNorms

__all__ = ["GradientCapture"]


class GradientCapture:
    """Squared norms of the local gradients, taken by parameter hooks during one backward.

    Args:
        parameters: the model's parameters (those that do not require a gradient are left out).
        norms: how a parameter's squared norm is taken (Adam's preconditioning, accumulation's earlier micro-batches).

    """

    def __init__(self, parameters: Iterable[torch.nn.Parameter], norms: GradientNorms) -> None:
        self.parameters = [p for p in parameters if p.requires_grad]
        self._norms = norms
        self._squares: list[torch.Tensor] = []
        self._handles: list[Any] = []

    @property
    def armed(self) -> bool:
        """Whether the hooks are in place (between :meth:`arm` and :meth:`disarm`)."""
        return bool(self._handles)

    def arm(self) -> None:
        """Hook every parameter for the next backward."""
        self._squares = []
        self._handles = [p.register_post_accumulate_grad_hook(self._measure) for p in self.parameters]

    def disarm(self) -> None:
        """Remove the hooks (after the backward, or at teardown)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def local_squared(self) -> torch.Tensor | None:
        """``|g|^2`` of this rank's local gradient in the last armed backward, summed over the parameters that got
        one (``None``: none did)."""
        if not self._squares:
            return None
        return torch.stack(self._squares).sum() if len(self._squares) > 1 else self._squares[0]

    def _measure(self, parameter: torch.Tensor) -> None:
        self._squares.append(self._norms.parameter(parameter, subtract_previous=True))
