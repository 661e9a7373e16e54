"""What a safety run is asked to do, and what it found (see :mod:`asynclock.testing._safety`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal


@dataclass(frozen=True)
class SafetyConfig:
    """One safety run. ``url`` is the lock backend, ``resource`` the shared resource's URL."""

    url: str
    resource: str
    workers: int = 4
    #: How long the workers contend; longer while fewer than ``min_takeovers`` stopped workers
    #: have been resumed after a newer hold used the resource (bounded by the run's grace
    #: period: then the run fails on its timeout), so the fault the checks need happened.
    duration: float = 8.0
    min_takeovers: int = 0
    ttl: float = 1.0
    fencing: bool = True
    #: Chance that a hold is paused between its read and its write, and how.
    pause_probability: float = 0.15
    pause_kind: Literal["stop", "block"] = "stop"
    #: How long a pause lasts; default 1.5 x ttl, long enough for the lease to expire.
    pause: float | None = None
    hold: float = 0.005
    #: False: leases are only flagged when lost (``on_lost="flag"``), so the guard alone stands
    #: between a stale holder and the resource.
    cancel_on_loss: bool = True
    #: Server faults: (seconds after the start, function) pairs, run in order in a thread.
    nemesis: Sequence[tuple[float, Callable[[], object]]] = ()
    lock: str = "safety"
    seed: int = 1
    #: What the workers hold: a lock; a permit of a semaphore of ``permits`` (its resource is
    #: a PostgreSQL log behind a permit guard, see ``_safety_permits``); an election's term.
    primitive: Literal["lock", "semaphore", "election"] = "lock"
    permits: int = 3

    def __post_init__(self) -> None:
        if self.min_takeovers > 0 and (self.pause_kind != "stop" or self.pause_probability <= 0):
            raise ValueError(
                "min_takeovers counts stopped workers resumed after a takeover: it needs "
                "pause_kind='stop' and a pause_probability above 0"
            )


@dataclass
class SafetyReport:
    """What a run did and what its checks found."""

    config: SafetyConfig
    holds: int = 0
    lost_leases: int = 0
    pauses: int = 0
    writes_accepted: int = 0
    writes_refused: int = 0
    final_value: int = 0
    lost_updates: int = 0
    stale_writes_accepted: int = 0
    #: Holds that overlapped a hold of another worker (either side of an overlap).
    overlapping_holds: int = 0
    #: Holds during which another worker acquired the lock: the stale holders.
    overtaken_holds: int = 0
    #: For each lost lease: seconds between the body's cancellation and the earliest server-side
    #: expiry (positive: cancelled in time; negative: the process was paused past it).
    cancel_margins: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    #: Lock, election: holds whose token was not larger than the previous hold's (terms'
    #: tokens must rise). Semaphore: tokens given to two holds.
    token_errors: int = 0
    #: Semaphore: the most holds at once as the workers saw them (more than ``permits``: a
    #: paused holder still thought it held a permit that had gone to another) ...
    most_holds_at_once: int | None = None
    #: ... and the most tokens with accesses accepted around one moment, at the resource
    #: (from each token's first accepted access to its last); ``stale_writes_accepted`` counts
    #: the accesses that found more than ``permits`` of them.
    most_writers_at_once: int | None = None

    @property
    def safe(self) -> bool:
        """No lost update, no stale write accepted (semaphore: no access beyond ``permits``
        writers at once), and the tokens rose."""
        return self.lost_updates == 0 and self.stale_writes_accepted == 0 and not self.token_errors

    def as_dict(self) -> dict[str, Any]:
        return {
            "backend": self.config.url.split("://")[0],
            "resource": self.config.resource.split("://")[0],
            "fencing": self.config.fencing,
            "cancel_on_loss": self.config.cancel_on_loss,
            "pause_kind": self.config.pause_kind,
            "workers": self.config.workers,
            "duration": self.config.duration,
            "ttl": self.config.ttl,
            "holds": self.holds,
            "lost_leases": self.lost_leases,
            "pauses": self.pauses,
            "writes_accepted": self.writes_accepted,
            "writes_refused": self.writes_refused,
            "final_value": self.final_value,
            "lost_updates": self.lost_updates,
            "stale_writes_accepted": self.stale_writes_accepted,
            "overlapping_holds": self.overlapping_holds,
            "overtaken_holds": self.overtaken_holds,
            "cancelled_before_expiry": sum(margin > 0 for margin in self.cancel_margins),
            "cancelled_after_expiry": sum(margin <= 0 for margin in self.cancel_margins),
            "primitive": self.config.primitive,
            "permits": self.config.permits if self.config.primitive == "semaphore" else None,
            "token_errors": self.token_errors,
            "most_holds_at_once": self.most_holds_at_once,
            "most_writers_at_once": self.most_writers_at_once,
            "safe": self.safe,
        }
