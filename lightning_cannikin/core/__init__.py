"""The maths of Cannikin, pure: numpy and the standard library, never torch or Lightning.

Plan types and bounds (:mod:`.plan`), the OptPerf solver (:mod:`.optperf`), timing and memory models
(:mod:`.timing`, :mod:`.memory`, :mod:`.sample_window`), the per-device speed model (:mod:`.speed_model`), the noise
scale (:mod:`.noise_scale`), goodput and learning-rate rules (:mod:`.goodput`, :mod:`.lr_scaling`), every "when" of a
run (:mod:`.replanner`), the plan history (:mod:`.history`) and the one decision policy (:mod:`.policy`) that both the
Lightning callback and the simulator call. See ``docs/architecture.md``.
"""
