"""``lease.extend(ttl)``: one renewal now, with a new ttl, never beside a background one."""

from __future__ import annotations

from collections.abc import Callable

import anyio

from ._clock import now
from ._errors import BackendUnavailable, LeaseLost, LockError, NotHeld
from ._lease import Lease
from ._scope import Deadlines
from ._supervisor import Supervisor
from .abc import Backend, Grant, Lost, Renewed, RenewOutcome, Unknown


async def extend(
    lease: Lease,
    ttl: float,
    margin_for: Callable[[float], float],
    *,
    backend: Backend[Grant],
    deadlines: Deadlines,
    supervisor: Supervisor,
) -> None:
    """Renew ``lease`` now with ``ttl`` (checked by the caller) and move its deadline.

    Only one renewal of a lease is ever in flight (``Lease.busy``): a background renewal and
    an extend could reach the server in either order, and the server would keep the ttl of
    whichever came last while the local deadline followed the other.
    """
    margin = margin_for(ttl)
    await lease._wait_idle()  # a background renewal in flight ends first
    if not lease.held:
        if lease.lost_reason is None:  # released by its holder: nothing was lost
            raise NotHeld(
                f"the lease on lock {lease.name!r} was released: extend() renews a held lease; "
                "take the lock again"
            )
        raise LeaseLost(lease.name, lease.lost_reason)
    lease.busy = True
    shorter = ttl < lease.ttl
    sent_at = now()
    outcome: RenewOutcome | None = None
    try:
        # Past the deadline the lease is lost whatever the server says.
        with anyio.move_on_at(lease.deadline):
            try:
                outcome = await backend.extend(lease.grant, ttl)
            except LockError:
                raise
            except Exception as exc:
                raise BackendUnavailable(
                    f"extending the lease on {lease.name!r} on {backend.describe()} failed: {exc!r}"
                ) from exc
        match outcome:
            case Renewed(valid_from=valid_from, ttl=applied):
                lease._set_ttl(
                    valid_from, applied, margin if applied == ttl else margin_for(applied)
                )
                deadlines.moved(lease.deadline)
            case Lost(reason=reason):
                lease._mark_lost(reason)
                raise LeaseLost(lease.name, reason)
            case Unknown(error=error):
                raise BackendUnavailable(
                    f"extending the lease on {lease.name!r} on {backend.describe()} proved "
                    f"nothing: {error!r}; the lease keeps its deadline"
                ) from error
            case None:
                lease._check_deadline()
                raise LeaseLost(
                    lease.name, lease.lost_reason or "extend() was not answered in time"
                )
    finally:
        if shorter and not isinstance(outcome, Renewed):
            # Unanswered or interrupted: the server may have applied the shorter ttl.
            lease._cap_deadline(sent_at, ttl, margin)
            deadlines.moved(lease.deadline)
        lease._set_idle()
        supervisor.add(lease)  # looked at again from its new next renewal
