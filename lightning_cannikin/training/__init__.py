"""The Lightning and torch layer on top of :mod:`lightning_cannikin.core`, by role.

The balancing engine (:mod:`~lightning_cannikin.training.engine`), the torch adapter that measures a step and carries
its :class:`~lightning_cannikin.core.controller.Controller`'s decisions; ``frontends/``, which drive it (the Lightning
strategies with their callback, the Fabric strategy); ``measurement/`` (the step timer, the weighted reductions and
the noise statistics on them, the loss's weights); ``data/`` (the uneven samplers, loaders and streams, and the plan in
force). See ``docs/architecture.md``.
"""
