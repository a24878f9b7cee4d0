"""The Lightning and torch layer on top of :mod:`lightning_cannikin.core`.

The balancing engine (:mod:`~lightning_cannikin.training.engine`) and its frontends: the Lightning callback and the
Fabric strategy, hook wiring that drives the engine; the strategy owns a
:class:`~lightning_cannikin.training.runtime.RuntimeState` shared with the engine, the uneven sampler and loader, the
weighted comm hook with the step timer and the gradient-norm observer riding on it, and the emulator. See
``docs/architecture.md``.
"""
