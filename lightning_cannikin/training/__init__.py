"""The Lightning and torch layer on top of :mod:`lightning_cannikin.core`.

The strategy owns a :class:`~lightning_cannikin.training.runtime.RuntimeState` that the callback reads and writes
(the callback never imports the strategy), the uneven sampler and loader, the weighted comm hook with the step timer
and the gradient-norm observer riding on it, and the emulator. See ``docs/architecture.md``.
"""
