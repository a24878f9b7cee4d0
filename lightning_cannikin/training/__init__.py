"""The Lightning and torch layer on top of :mod:`lightning_cannikin.core`.

The balancing engine (:mod:`~lightning_cannikin.training.engine`), the one object that owns a training step, and its
frontends, which drive it through its step API: the Lightning strategies (DDP, FSDP2) with their callback, and the
Fabric strategy. Behind the engine: the uneven sampler and loader, the weighted comm hook with the step timer and the
gradient-norm observer riding on it. See ``docs/architecture.md``.
"""
