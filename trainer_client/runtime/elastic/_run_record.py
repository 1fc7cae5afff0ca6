"""What an elastic run records: its events, its recoveries (each from detection to the first step done on the
new mesh, with the tier it restored from) and its result. ``ElasticRunner`` fills them; the demo's
``report.json``, the soak and the benchmarks read them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Generic, Literal, TypeVar

from trainer_client.core.protocol import Tier

T = TypeVar("T")


@dataclass(frozen=True)
class Event:
    kind: str
    step: int | None
    t: float  # seconds since the run started
    detail: str = ""
    wall_time: float = 0.0  # time.time() when emitted
    fields: dict[str, Any] = field(default_factory=dict)  # structured extras (protocol.ElasticEvent fields)


@dataclass
class Recovery:
    """One elastic event, from detection to the first completed step on the new mesh."""

    kind: Literal["slice_down", "scale_up"]
    failed_at_step: int
    detected_t: float
    restored_step: int | None = None
    lost_steps: int | None = None
    mesh_before: list[int] = field(default_factory=list)
    mesh_after: list[int] = field(default_factory=list)
    slices_before: list[int] = field(default_factory=list)  # the slices the mesh used
    slices_after: list[int] = field(default_factory=list)
    spares_used: list[int] = field(default_factory=list)  # hot spares that took lost slices' places
    seconds: float | None = None
    restored_from: str | None = None  # ``restored_from(tier, path)`` of the step restored

    def restored(self, step: int | None, tier: str | None = None, path: str = "") -> None:
        """The step the recovery restored (None: it started afresh) and, when known, from which tier."""
        self.restored_step = step if step is not None else 0
        self.lost_steps = self.failed_at_step - self.restored_step
        if tier is not None or step is None:
            self.restored_from = restored_from(tier, path) if tier is not None else None

    def on_mesh(self, shape: list[int], slices: list[int], spares: bool) -> None:
        """The mesh and slices after the event; with hot spares (``spares``) and the same mesh shape, the spare
        slices that took lost ones' places."""
        self.mesh_after, self.slices_after = shape, slices
        if self.kind == "slice_down" and spares and self.mesh_after == self.mesh_before:
            self.spares_used = sorted(set(slices) - set(self.slices_before))

    def summary(self) -> str:
        """One line: what was lost, how long to the first step, where the state came from."""
        spare = f", spare slice(s) {self.spares_used} in" if self.spares_used else ""
        return (f"{self.kind} at step {self.failed_at_step}: {self.seconds or 0.0:.2f}s to the first step, "
                f"{self.lost_steps} step(s) lost{spare}, restored from {self.restored_from or 'nothing'}")


@dataclass
class ElasticResult(Generic[T]):
    value: T
    pid: int
    events: list[Event]
    recoveries: list[Recovery]
    final_step: int | None
    # a multi-controller job stopped at the step its processes agreed on after a preemption notice (SIGTERM),
    # that step saved to storage; ``value`` is None then (the training function did not return)
    preempted: bool = False


def restored_from(tier: str, path: str) -> str:
    """Where a recovery restored from, as the report says it: ``replicas``, ``memory: PATH``, ``storage: PATH``."""
    return tier if tier == Tier.REPLICAS or not path else f"{tier}: {path}"


__all__ = ["ElasticResult", "Event", "Recovery", "restored_from"]
