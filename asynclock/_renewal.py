"""When leases are renewed: decided here, once, for the core and for any backend-side keepalive.

DistributedLock renews at a third of the validity; Curator, redsync and etcd's Go client at
similar shares. A third leaves two more tries before the local deadline when one fails.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ("RENEWAL", "RenewalPolicy")


@dataclass(frozen=True, slots=True)
class RenewalPolicy:
    #: A lease is renewed this share of its ttl after the request that started it was sent.
    interval: float = 1 / 3
    #: A lease due within this share of its ttl rides along with a batch that is due now, so
    #: the phases of many leases converge and 10,000 locks cost one round trip per interval.
    batch_window: float = 1 / 6
    #: After a renewal that proved nothing, try again after this share of the interval.
    retry_fraction: float = 0.25
    #: ... but never sooner than this many seconds.
    min_retry: float = 0.01

    def next_after(self, valid_from: float, ttl: float) -> float:
        """When a lease valid from ``valid_from`` for ``ttl`` seconds is renewed next."""
        return valid_from + ttl * self.interval

    def retry_at(self, now: float, ttl: float) -> float:
        """When to try again after a renewal at ``now`` that proved nothing."""
        return now + max(self.min_retry, ttl * self.interval * self.retry_fraction)

    def suspect_after(self, ttl: float) -> float:
        """How long a renewal may go unanswered before the server counts as unreachable (the
        client's state turns SUSPENDED): the retry spacing, which a healthy round trip never
        comes near."""
        return max(self.min_retry, ttl * self.interval * self.retry_fraction)

    def joins_batch(self, next_renewal: float, ttl: float, now: float) -> bool:
        """Whether a lease due at ``next_renewal`` is renewed with a batch that is due ``now``."""
        return next_renewal - ttl * self.batch_window <= now

    def leaves_time_to_renew(self, ttl: float, local_validity: float) -> bool:
        """Whether a local deadline ``local_validity`` seconds after the start comes after the
        first renewal (if not, every lease would be lost before it is renewed)."""
        return local_validity > ttl * self.interval


#: The policy in force.
RENEWAL = RenewalPolicy()
