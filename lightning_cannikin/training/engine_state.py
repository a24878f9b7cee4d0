"""What a checkpoint keeps of the balancing engine, and how a resume puts it back."""

from __future__ import annotations

from typing import Any

__all__ = ["engine_state", "restore_engine"]


def engine_state(engine: Any) -> dict[str, Any]:
    """Everything a resume of ``engine`` (a :class:`~lightning_cannikin.training.engine.BalancingEngine`) needs."""
    runtime = engine.runtime
    return {
        "balancer": engine.speed_model.state_dict() if engine.speed_model is not None else None,
        "estimator": engine.estimator.state_dict() if engine.estimator is not None else None,
        "progress": engine.progress.state_dict(),
        "lr_factor": runtime.lr_factor if runtime is not None else 1.0,
        "gain": runtime.gain if runtime is not None else 1.0,
        "plan": engine.plan.to_dict() if engine.plan is not None else None,
        "history": engine.history.entries,
        "step": engine.step,
        "identified": engine.identified,
        "last_adapt_step": engine.schedule.last_adapt_step,
        "adapted": engine.schedule.adapted,
        "last_replan_step": engine.schedule.last_replan_step,
        "routine_gap": engine.schedule.routine_gap,
        "noise_band": engine.schedule.noise_band,
        "band_total": engine.schedule.band_total,
        "noise_in_flight": engine.observer.state_dict() if engine.observer is not None else None,
    }


def restore_engine(engine: Any, state: dict[str, Any]) -> None:
    """Put a checkpoint's ``state`` back into ``engine`` (at training start: the estimator needs B0)."""
    if state["balancer"] is not None and engine.speed_model is not None:
        engine.speed_model.load_state_dict(state["balancer"])
        engine.speed_model.restarted()
    if state["estimator"] is not None and engine.estimator is not None:
        engine.estimator.load_state_dict(state["estimator"])
    engine.progress.load_state_dict(state["progress"])
    engine.history.entries = list(state["history"])
    engine.step = engine.schedule.last_replan_step = state["step"]
    engine.schedule.last_adapt_step = int(state["last_adapt_step"])
    engine.schedule.adapted = bool(state["adapted"])
    engine.schedule.last_replan_step = int(state["last_replan_step"])
    engine.schedule.routine_gap = int(state["routine_gap"])
    band = state["noise_band"]
    engine.schedule.noise_band = None if band is None else (float(band[0]), float(band[1]))
    engine.schedule.band_total = state["band_total"]
    if state["noise_in_flight"] is not None and engine.observer is not None:
        engine.observer.load_state_dict(state["noise_in_flight"])
    world_size = engine.collective.world_size if engine.collective is not None else 1
    same_devices = state["balancer"] is not None and state["balancer"]["world_size"] == world_size
    engine.identified = bool(state["identified"]) and same_devices
