"""This rank's local gradient, measured before DDP's own C++ all-reduce replaces it: the noise statistics' input.

The noise statistics need each rank's gradient before the reduction and the reduced one after. Through the Python
comm hook they see every bucket; DDP's own all-reduce has no Python seam, but it leaves one. DDP copies each
gradient into its bucket when the gradient is ready, all-reduces the bucket on its own, and only when backward ends
(in the autograd engine's final callback) copies the reduced values back over the gradients. Until then every
``.grad`` still holds the local gradient. So on a measured step a hook on the loss, the first node backward runs,
queues a final callback ahead of DDP's: it runs after the last bucket's all-reduce has started and before any result
is copied back, and takes the local squared norm of every gradient in one fused pass while that all-reduce is in
flight. It delays no bucket and costs one Python call, however many parameters the model has (on a CPU it shares the
cores with the all-reduce).

With ``gradient_as_bucket_view=True`` the gradients *are* the buckets, reduced in place while that callback would
read them: there a post-accumulate-grad hook on every parameter takes its norm before the bucket goes out (one read
of the gradient, on the critical path of backward; the hook runs inside the gradient's accumulation, before DDP's own
hook on it marks it ready). On CPU the same hooks are used: there the fused pass beside the all-reduce shares the
cores with gloo's threads and holds the reduction back (measured in alternate blocks of one run: 1.1% of the step
time, against the norms taken during backward), where on a GPU it runs beside the collective for free.

The hooks exist only during measured backwards (registered before, removed after): an unmeasured step costs nothing.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from lightning_cannikin.training._lightning_compat import queue_backward_callback
from lightning_cannikin.training.grad_norms import GradientNorms

__all__ = ["GradientCapture"]


class GradientCapture:
    """Squared norm of the local gradient of one backward, taken before DDP's all-reduce replaces it.

    Args:
        parameters: the model's parameters (those that do not require a gradient are left out).
        norms: how the squared norm is taken (Adam's preconditioning, accumulation's earlier micro-batches).
        per_parameter: measure each parameter by its own hook as its gradient is accumulated, before DDP takes it:
            needed where the gradients are views of DDP's buckets (``gradient_as_bucket_view=True``), reduced in
            place; chosen on CPU too (see above).

    """

    def __init__(
        self, parameters: Iterable[torch.nn.Parameter], norms: GradientNorms, per_parameter: bool = False
    ) -> None:
        self.parameters = [p for p in parameters if p.requires_grad]
        self.per_parameter = per_parameter
        self._norms = norms
        self._squares: list[torch.Tensor] = []
        self._handles: list[Any] = []

    @property
    def armed(self) -> bool:
        """Whether the hooks are in place (between :meth:`arm` and :meth:`disarm`)."""
        return bool(self._handles)

    def arm(self, loss: torch.Tensor) -> None:
        """Measure the backward of ``loss`` that comes next."""
        self._squares = []
        if not loss.requires_grad:
            return  # no backward will run: it raises its own error, not a hook's
        self._handles = [loss.register_hook(self._queue)]
        if self.per_parameter:
            self._handles += [p.register_post_accumulate_grad_hook(self._measure) for p in self.parameters]

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

    def _queue(self, grad: torch.Tensor) -> None:
        # the loss's gradient comes before any parameter's, so DDP has queued nothing yet: this runs before its
        # final callback copies the reduced buckets back
        queue_backward_callback(self._measure_all)

    def _measure_all(self) -> None:
        # per parameter, the parameters' own hooks measured every gradient during backward; a rank whose
        # parameters got none measures a zero either way (the exchange that follows needs every rank's block)
        if not self.per_parameter or not self._squares:
            self._squares.append(self._norms.gradients(self.parameters, since_previous=True))

    def _measure(self, parameter: torch.Tensor) -> None:
        self._squares.append(self._norms.parameter(parameter, subtract_previous=True))
