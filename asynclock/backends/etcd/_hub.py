"""One watch stream per client, shared by all its waiters (as Go's ``clientv3`` watcher does).

A stream of its own per waiter cost a gRPC call, two reader and writer tasks and their buffers
(about 40 KB of Python heap a waiter) and an HTTP/2 stream set up on every hand-over. Here a
waiter adds its watches to the client's one stream and is told, through :class:`Subscriber`,
when they are created, when a watched key is deleted, and when the stream fails (then every
waiter on it looks again, and the next watch opens a new stream).

etcd answers the create requests of one stream in the order they were sent, and sends a
watch's events only after its "created" answer (as Go's client relies on), so each "created"
belongs to the oldest create still unanswered; no client-chosen watch ids (etcd < 3.4 ignores
them).

:class:`BidiStream` is the shape of both long-lived calls of a client: the watch stream here,
and the keepalive stream (``_lease.py``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any, Final, Protocol

import anyio
import grpc
from aetcd import rpc

from .._kit import BackendUnavailable, TaskHost
from ._proto import prefix_end
from ._wire import Wire

__all__ = ("BidiStream", "NameWatch", "Stream", "Subscriber", "WatchHub", "delete_watch")

#: A lock name's watch (:class:`NameWatch`) outlives its last waiter by this long, so that a
#: task taking a lock over and over does not create and cancel it every time.
NAME_WATCH_LINGER: Final = 1.0


class Subscriber(Protocol):
    """A waiter, told about its watches (from the stream's reader task: never block)."""

    def on_created(self, revision: int) -> None: ...

    def on_fired(self, events: Sequence[Any]) -> None:
        """Deletes (``events``), or (none) the watch ended: look again."""

    def on_failed(self, error: BaseException) -> None: ...


def delete_watch(key: bytes, start_revision: int = 0, range_end: bytes = b"") -> Any:
    """A create request for a watch on the deletes of ``key`` (0: from now)."""
    return rpc.WatchCreateRequest(
        key=key,
        range_end=range_end,
        start_revision=start_revision,
        filters=[rpc.WatchCreateRequest.NOPUT],
    )


class NameWatch:
    """One watch on the deletes of every key of a lock name, shared by the client's waiters
    for it whose key before theirs is the client's own (each event goes to the waiters
    watching that key). A waiter of ours leaving the queue of a name that others of ours
    still wait for then costs no watch created or cancelled, only one event."""

    __slots__ = ("_all", "_by_key", "_count", "created", "created_at", "idle_since", "start")

    def __init__(self, start: int) -> None:
        #: The revision it watches from; ``created`` is etcd's revision when it was created
        #: (at ``created_at``, the loop's clock).
        self.start = start
        self.created: int | None = None
        self.created_at = 0.0
        self._by_key: dict[bytes, list[Subscriber]] = {}
        #: Told every event, whatever its key (a waiter whose read is in flight).
        self._all: dict[Subscriber, None] = {}
        self._count = 0
        self.idle_since: float | None = anyio.current_time()

    def maybe_unsynced(self, now: float) -> bool:
        """Whether etcd may still deliver its events late: it started in the past (something
        was written between its start and its creation), less than 0.2 s ago; etcd catches
        such a watch up from a loop that runs every 100 ms."""
        created = self.created
        return created is None or (created >= self.start and now - self.created_at < 0.2)

    def add_all(self, subscriber: Subscriber) -> None:
        """Tell ``subscriber`` every event from now on, until :meth:`remove_all`."""
        if subscriber not in self._all:
            self._all[subscriber] = None
            self._count += 1
        self.idle_since = None

    def remove_all(self, subscriber: Subscriber) -> None:
        if self._all.pop(subscriber, 0) is None:
            self._count -= 1
            if not self._count:
                self.idle_since = anyio.current_time()

    def add(self, subscriber: Subscriber, keys: Iterable[bytes]) -> None:
        for key in keys:
            self._by_key.setdefault(key, []).append(subscriber)
            self._count += 1
            if self.created is not None:
                subscriber.on_created(self.created)
        self.idle_since = None

    def remove(self, subscriber: Subscriber, keys: Iterable[bytes]) -> None:
        for key in keys:
            subscribers = self._by_key.get(key)
            if subscribers is not None and subscriber in subscribers:
                subscribers.remove(subscriber)
                self._count -= 1
                if not subscribers:
                    del self._by_key[key]
        if not self._count:
            self.idle_since = anyio.current_time()

    def _everyone(self) -> list[Subscriber]:
        everyone = dict.fromkeys(sub for subs in self._by_key.values() for sub in subs)
        everyone.update(self._all)
        return list(everyone)

    def on_created(self, revision: int) -> None:
        self.created = revision
        self.created_at = anyio.current_time()
        for subscribers in list(self._by_key.values()):
            for subscriber in list(subscribers):
                subscriber.on_created(revision)

    def on_fired(self, events: Sequence[Any]) -> None:
        if not events:  # the watch ended: everyone looks again
            for subscriber in self._everyone():
                subscriber.on_fired(())
            return
        for event in events:
            keyed = self._by_key.get(bytes(event.kv.key), ())
            for subscriber in list(self._all) + [sub for sub in keyed if sub not in self._all]:
                subscriber.on_fired((event,))

    def on_failed(self, error: BaseException) -> None:
        for subscriber in self._everyone():
            subscriber.on_failed(error)


class WatchHub:
    """The client's watch stream, opened on first use and again after it failed."""

    def __init__(self, wire: Wire, host: TaskHost) -> None:
        self._wire = wire
        self._host = host
        self._stream: Stream | None = None

    def stream(self) -> Stream:
        """The live stream (opened now if there is none). Its methods never await, so
        nothing can interrupt them half done."""
        stream = self._stream
        if stream is None or stream.dead:
            stream = self._stream = Stream(self._wire)
            self._host.start_soon(stream.run, name="asynclock: etcd watch stream")
        return stream

    async def aclose(self) -> None:
        """End the stream, and wait (a bounded while) until its reader has seen the call end: a
        read still pending when the event loop closes makes gRPC's poller fail on it."""
        stream, self._stream = self._stream, None
        if stream is not None:
            stream.end(BackendUnavailable(f"{self._wire.describe} is closed"))
            with anyio.CancelScope(shield=True), anyio.move_on_after(1.0):
                await stream.stopped.wait()

    def current_name_watch(self, prefix: bytes) -> NameWatch | None:
        """The name watch of ``prefix`` on the live stream, if there is one (opens no stream)."""
        stream = self._stream
        return None if stream is None else stream.current_name_watch(prefix)

    @property
    def watches(self) -> int:
        """Watches open or being created on the stream (``extra_info``)."""
        stream = self._stream
        return 0 if stream is None or stream.dead else stream.watches


class BidiStream(ABC):
    """One bidirectional gRPC call (a watch or a keepalive stream), its writer and its reader,
    run by :meth:`run` in the backend's task host. A request is queued (:meth:`send`, no await)
    and written in order by the writer: no caller awaits the call, so no caller's cancellation
    reaches it (gRPC ends a call whose read or write is cancelled). Each reply goes to
    :meth:`_received`. :meth:`end` cancels the call and fails what waits on it
    (:meth:`_ended`), once; so does an error of the call or its end on the server."""

    #: What the stream carries, for messages.
    kind = "bidirectional"

    def __init__(self, call: Any, describe: str) -> None:
        self._call = call
        self._describe = describe
        self.dead = False
        self._out: deque[Any] = deque()
        self._more = anyio.Event()
        #: Set once the reader and the writer are done with the call.
        self.stopped = anyio.Event()

    @abstractmethod
    def _received(self, response: Any) -> None:
        """A reply of the server (the call is live)."""

    @abstractmethod
    def _ended(self, error: BaseException) -> None:
        """The stream is done: fail what waits on it with ``error``."""

    def _idle_after(self) -> float | None:
        """How long the writer waits for a request before :meth:`_idle` (None: for ever)."""
        return None

    def _idle(self) -> None:  # noqa: B027 - a hook, with nothing to do by default
        """The writer has written all it had (or waited ``_idle_after``)."""

    def send(self, request: Any) -> None:
        self._out.append(request)
        self._more.set()

    def end(self, error: BaseException) -> None:
        if self.dead:
            return
        self.dead = True
        self._call.cancel()
        self._more.set()
        self._ended(error)

    async def run(self) -> None:
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._write)
                await self._read()
        finally:
            self.stopped.set()

    async def _write(self) -> None:
        try:
            while not self.dead:
                while self._out and not self.dead:
                    await self._call.write(self._out.popleft())
                self._more = anyio.Event()
                if not self._out and not self.dead:
                    with anyio.move_on_after(self._idle_after()):
                        await self._more.wait()
                self._idle()
        except BaseException as exc:
            self._failed(exc)

    async def _read(self) -> None:
        try:
            while not self.dead:
                response = await self._call.read()
                if response is grpc.aio.EOF:
                    self.end(BackendUnavailable(f"{self._describe}: the {self.kind} stream ended"))
                    return
                self._received(response)
        except BaseException as exc:
            self._failed(exc)

    def _failed(self, exc: BaseException) -> None:
        """The reader or the writer raised: the call failed, or :meth:`end` cancelled it under
        them (gRPC raises a bare ``CancelledError`` then: ours, swallowed), or the backend is
        closing (re-raised)."""
        ours = self.dead
        if isinstance(exc, Exception):
            self.end(exc)
            return
        self.end(BackendUnavailable(f"{self._describe}: the {self.kind} stream was cancelled"))
        if not ours:
            raise exc


class Stream(BidiStream):
    """The Watch call: its watches, created in the order they were asked for."""

    kind = "watch"

    def __init__(self, wire: Wire) -> None:
        # hasleader: a member cut off from the cluster ends the stream instead of going quiet.
        super().__init__(
            wire.watch.Watch(metadata=(*wire.metadata, ("hasleader", "true"))), wire.describe
        )
        #: Creates sent and not answered yet, oldest first: their subscriber (None: dropped).
        self._pending: deque[list[Subscriber | None]] = deque()
        self._by_id: dict[int, Subscriber] = {}
        self._ids: dict[Subscriber, list[int]] = {}
        self._slots: dict[Subscriber, list[list[Subscriber | None]]] = {}
        self._names: dict[bytes, NameWatch] = {}

    @property
    def watches(self) -> int:
        return len(self._by_id) + len(self._pending)

    def add(self, subscriber: Subscriber, requests: list[Any]) -> None:
        if self.dead:
            subscriber.on_failed(BackendUnavailable(f"{self._describe}: the watch stream ended"))
            return
        slots = self._slots.setdefault(subscriber, [])
        for request in requests:
            slot: list[Subscriber | None] = [subscriber]
            slots.append(slot)
            self._pending.append(slot)
            self.send(rpc.WatchRequest(create_request=request))

    def name_watch(self, prefix: bytes, start: int) -> NameWatch:
        """The watch on the deletes of the keys under ``prefix`` (one lock name), made from
        revision ``start`` if there is none."""
        watch = self._names.get(prefix)
        if watch is None:
            watch = self._names[prefix] = NameWatch(start)
            self.add(watch, [delete_watch(prefix, start, prefix_end(prefix))])
        return watch

    def current_name_watch(self, prefix: bytes) -> NameWatch | None:
        """The name watch of ``prefix`` on this stream, if there is one."""
        return None if self.dead else self._names.get(prefix)

    def _idle_after(self) -> float | None:
        return NAME_WATCH_LINGER if self._names else None

    def _idle(self) -> None:
        """Cancel the name watches that have had no waiter for a while."""
        now = anyio.current_time()
        for prefix, watch in list(self._names.items()):
            if watch.idle_since is not None and now - watch.idle_since >= NAME_WATCH_LINGER:
                del self._names[prefix]
                self.drop(watch)

    def drop(self, subscriber: Subscriber) -> None:
        """Cancel the subscriber's watches (those not created yet, once they are)."""
        for slot in self._slots.pop(subscriber, ()):
            slot[0] = None
        for watch_id in self._ids.pop(subscriber, ()):
            self._cancel(watch_id)

    def _cancel(self, watch_id: int) -> None:
        self._by_id.pop(watch_id, None)
        if not self.dead:
            request = rpc.WatchCancelRequest(watch_id=watch_id)
            self.send(rpc.WatchRequest(cancel_request=request))

    def _ended(self, error: BaseException) -> None:
        """Every subscriber still on the stream is told."""
        subscribers = list(self._slots) + [sub for sub in self._ids if sub not in self._slots]
        self._pending.clear()
        self._by_id.clear()
        self._ids.clear()
        self._slots.clear()
        self._names.clear()
        for subscriber in subscribers:
            subscriber.on_failed(error)

    def _received(self, response: Any) -> None:
        watch_id = int(response.watch_id)
        if response.created:
            slot: list[Subscriber | None] = self._pending.popleft() if self._pending else [None]
            subscriber = slot[0]
            if subscriber is not None:
                slots = self._slots.get(subscriber)
                if slots is not None and slot in slots:
                    slots.remove(slot)
                    if not slots:
                        del self._slots[subscriber]
            if response.canceled or watch_id < 0:
                # Refused (a compacted start revision, say): let the waiter look again.
                if subscriber is not None:
                    self._forget(subscriber)
                    subscriber.on_fired(())
                return
            if subscriber is None:
                self._cancel(watch_id)
                return
            self._by_id[watch_id] = subscriber
            self._ids.setdefault(subscriber, []).append(watch_id)
            subscriber.on_created(int(response.header.revision))
            if not (response.events or response.compact_revision):
                return
        subscriber_or_none = self._by_id.get(watch_id)
        if subscriber_or_none is None:
            return  # a cancelled watch's last word
        if response.canceled or response.compact_revision:
            # etcd ended the watch (compacted past its revision, say).
            del self._by_id[watch_id]
            self._forget(subscriber_or_none)
            subscriber_or_none.on_fired(())
        elif response.events:
            subscriber_or_none.on_fired(response.events)

    def _forget(self, subscriber: Subscriber) -> None:
        """A name watch that etcd ended: the next waiter makes a new one."""
        for prefix, watch in list(self._names.items()):
            if watch is subscriber:
                del self._names[prefix]
