"""``Reductions``: where a step's gradients are reduced, and what watches them on the way.

The weighted all-reduce's state (:class:`~lightning_cannikin.training.measurement.comm_hook.WeightedAllReduceState`),
the step timer that times the rank's compute around it (:mod:`~lightning_cannikin.training.measurement.step_timer`)
and, where the noise scale is measured, the gradient statistics' observer
(:mod:`~lightning_cannikin.training.measurement.grad_stats`). A frontend reaches them through the seams here (DDP's
comm hook, FSDP2's reduce-scatter, a gradient ready, a wait in a collective), never through the parts themselves
(``tests/test_layering.py``); the engine reads what they measured.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from lightning_cannikin.core.speed_model import StepRecord
from lightning_cannikin.training.measurement.comm_hook import WeightedAllReduceState, weighted_allreduce_hook
from lightning_cannikin.training.measurement.grad_stats import GradientNormObserver
from lightning_cannikin.training.measurement.loss_weights import StepWeights
from lightning_cannikin.training.measurement.sharded_grad_stats import NoiseReduceScatter, ShardedGradientNormObserver
from lightning_cannikin.training.measurement.step_timer import HostClock, StepTimer, step_timer_for

__all__ = ["Reductions"]


class Reductions:
    """One rank's gradient reductions and their watchers: the all-reduce's state, the step timer, the noise observer."""

    def __init__(self) -> None:
        self.state = WeightedAllReduceState()
        self.timer = StepTimer()
        self.state.observers.append(self.timer)
        self.observer: GradientNormObserver | None = None

    def watch_noise(
        self, rank: int, world_size: int, sharded: bool, every: tuple[int, int], cadence: Callable[[], int]
    ) -> None:
        """Measure the noise statistics (of the reduce-scatters where the gradients are ``sharded``): ``every`` is
        ``(noise_exchange_every, noise_every_n_steps)``, ``cadence`` the steps per measurement at each step's start.
        The observer sees every bucket after the timer."""
        observer_type = ShardedGradientNormObserver if sharded else GradientNormObserver
        observer = self.observer = observer_type(rank, world_size, None, *every)
        observer.cadence = cadence
        self.state.observers.append(observer)

    def use_device(self, device: torch.device) -> None:
        """Time on ``device`` from now on: CUDA events on a GPU, the host clock elsewhere."""
        timer = step_timer_for(device)
        observers = self.state.observers
        observers[observers.index(self.timer)] = timer
        timer.listeners = self.timer.listeners
        self.timer = timer

    @property
    def measures_noise(self) -> bool:
        """Whether the noise statistics are measured: they must see every gradient bucket (DDP's comm hook)."""
        return self.observer is not None

    @property
    def host_clock(self) -> bool:
        """Whether steps are timed on the host clock (on CPU the host waits inside collectives)."""
        return isinstance(self.timer.clock, HostClock)

    @property
    def latest_record(self) -> StepRecord | None:
        """This rank's newest step record the timer has read (for logging)."""
        return self.timer.latest

    # -- the frontends' seams ----------------------------------------------------------------------------------------

    def comm_hook(self) -> tuple[WeightedAllReduceState, Callable[..., Any]]:
        """``(state, hook)`` to register as DDP's comm hook: the weighted all-reduce its observers see."""
        return self.state, weighted_allreduce_hook

    def reduce_with(self, loss_carries_weight: bool, averaged_over: int = 1) -> None:
        """How the frontend reduces: whether the loss carries the rank's weight (one scalar product instead of a pass
        over every bucket) and over how many ranks its reduction averages (DDP's own all-reduce, FSDP2's
        reduce-scatter: ``n * b_i / B`` on the loss makes their mean the weighted mean; 1 where the comm hook sums)."""
        self.state.weight_in_loss, self.state.mean_over = loss_carries_weight, averaged_over

    def gradient_ready(self) -> None:
        """A gradient (bucket) is ready for its reduction: the first of a step marks where gradients start, every one
        the latest."""
        self.timer.gradient_ready()

    def host_waited(self, seconds: float) -> None:
        """The host waited ``seconds`` for other ranks inside a collective of this step (FSDP2 on CPU): not compute."""
        self.timer.blocked(seconds)

    def reduction_done(self, reduced: torch.Tensor) -> None:
        """A reduction the comm hook does not see (FSDP2's reduce-scatter) returned ``reduced``."""
        self.timer.after_reduce(None, None, reduced)  # type: ignore[arg-type]

    def reduce_scatter_for(self, module: Any, reduce_scatter: Any) -> Any:
        """FSDP2's reduce-scatter of one sharded ``module``: ``reduce_scatter``, seen first by the noise statistics
        where they are measured (an object FSDP2's ``set_custom_reduce_scatter`` accepts)."""
        observer = self.observer
        if not isinstance(observer, ShardedGradientNormObserver):
            return reduce_scatter
        # Adam's preconditioner is all-gathered on measured steps: a wait, not compute
        observer.blocked = self.timer.blocked if self.host_clock else None
        return NoiseReduceScatter(reduce_scatter, observer, module)

    def state_dict(self) -> dict[str, Any] | None:
        """The noise statistics in flight (``None`` where none are measured)."""
        return self.observer.state_dict() if self.observer is not None else None

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """The noise statistics in flight back, where both the checkpoint and this run measure them."""
        if state is not None and self.observer is not None:
            self.observer.load_state_dict(state)

    # -- the engine's side -------------------------------------------------------------------------------------------

    def start_step(self, optimizer_step: int, after_input: bool) -> None:
        """A step starts (``after_input``: its input was timed): time it, and say whether the noise statistics measure
        this optimizer step (before its first backward)."""
        self.timer.start(after_input=after_input)
        if self.observer is not None:
            self.observer.start_step(optimizer_step)

    def weigh(self, weights: StepWeights, accumulation: int) -> float:
        """The step's ``weights`` on the all-reduce; returns the factor on the loss: the rank's weight where the loss
        carries it (times ``n`` where the reduction averages) and the micro-batch's share of its window."""
        state = self.state
        state.weight, state.micro_weight, state.unit_scale = weights.rank, weights.micro, weights.unit_scale
        state.global_scale = weights.global_scale
        weight = state.weight * state.mean_over if state.weight_in_loss else 1.0
        return accumulation * state.micro_weight * weight

    def backward_done(self, parameters: Callable[[], Iterable[torch.Tensor]]) -> None:
        """A backward ended: an accumulation micro-step's gradient is a noise group of its own, and a sharded window's
        reduced shards close its block (``parameters`` read only where the statistics need them)."""
        timer, observer = self.timer, self.observer
        timer.backward_done()
        if observer is None:
            return
        if not timer.reduced:
            observer.after_micro_step(parameters(), self.state.local_scale)
        elif isinstance(observer, ShardedGradientNormObserver):
            observer.reduced(self.state, parameters())
