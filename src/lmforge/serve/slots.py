"""One generation at a time per model, behind a bounded queue.

A request reserves a place (``ModelSlots.reserve``) before anything is generated: past
``queue_size`` waiting requests that is a 429 with ``Retry-After``, answered at once. The
``Ticket`` then waits its turn for the model (``acquire``), and frees its place when the
worker thread that generated for it has ended -- not merely when the client went away, so
that two generations never share a model -- or at once when it never got to run.

Everything here runs on the event loop's thread; only ``cancel`` is read by the worker.
"""

from __future__ import annotations

import asyncio
import threading

from lmforge.serve.errors import ApiError

RETRY_AFTER_S = 1  # a tiny model answers in about that; the client then asks again


class ModelSlots:
    """The generating request and those waiting, for one model."""

    def __init__(self, name: str, queue_size: int) -> None:
        self.name, self.queue_size = name, queue_size
        self.lock = asyncio.Lock()  # binds to the running loop on first use
        self.held = 0  # the generating request (if any) and those waiting

    def reserve(self) -> Ticket:
        """A place in the queue, or a 429 when ``queue_size`` requests already wait."""
        if self.held > self.queue_size:
            raise ApiError(429, f"model '{self.name}' is busy: {self.queue_size} requests "
                           "already wait for it; retry shortly", code="queue_full",
                           headers={"Retry-After": str(RETRY_AFTER_S)})
        self.held += 1
        return Ticket(self)


class Ticket:
    """One request's place: wait for the model, run, and free the place exactly once."""

    def __init__(self, slots: ModelSlots) -> None:
        self.slots = slots
        self.cancel = threading.Event()  # set when nobody wants the rest of the answer
        self._locked = self._running = self._freed = False

    async def acquire(self) -> None:
        """Wait until the model is free (cancelling the wait holds nothing). A ticket
        closed while it waited gives the model straight back: its place is freed."""
        await self.slots.lock.acquire()
        if self._freed:
            self.slots.lock.release()
            raise asyncio.CancelledError("the request was closed while it waited")
        self._locked = True

    @property
    def generating(self) -> bool:
        """Whether this request has the model (it is not waiting for it)."""
        return self._locked

    def running(self, worker: asyncio.Future) -> None:
        """The worker generating for this ticket; the place is freed when it ends."""
        self._running = True
        worker.add_done_callback(lambda _: self._free())

    def close(self) -> None:
        """The request is over (answered, failed or disconnected): stop the worker, and
        free the place now unless a worker still runs (then it frees it when it ends)."""
        self.cancel.set()
        if not self._running:
            self._free()

    def _free(self) -> None:
        if self._freed:
            return
        self._freed = True
        if self._locked:
            self.slots.lock.release()
        self.slots.held -= 1
