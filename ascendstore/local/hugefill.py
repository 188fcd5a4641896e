"""2 MiB pages for a pool that is not prefaulted, made as the pool fills.

On a ``/dev/shm`` mounted ``huge=never`` (the usual mount) a pool's memory comes in
4 KiB pages as puts first touch it. Where the host's free memory is fragmented those
pages lie scattered, and 64 KiB gets measured at half the speed of gets from 2 MiB
pages (docs/benchmarking.md); every process that maps the pool also needs 512x the
page-table entries (~400 MiB per process for a 200 GiB pool). ``prefault: true``
has the kernel make the whole arena 2 MiB pages at creation, which costs seconds per
GiB before the first put and commits the whole capacity at once.

This does the same lazily: a daemon thread has the kernel make each 2 MiB stretch
of the arena one 2 MiB page just before the pool's fill reaches it
(``Pool.collapse_step``: ``MADV_COLLAPSE``, Linux 6.1+), so memory is still taken as
the pool fills, and puts do not make pages (one that touches a stretch while the kernel
makes it waits for that stretch). Where the kernel cannot (an older kernel, no free
2 MiB block), the pool goes on in 4 KiB pages.

Every process that opens the pool runs the thread; one live process at a time does
the work, and the others' threads look again every few seconds. Engines sharing a pool
outlive the one that created it (a rolling restart): when the process doing the work
closes the pool or dies, another takes over, and the pool's later fill still gets
2 MiB pages. So it does from a process stopped for seconds (``_STALE_S``) while it
held the role; that one finds the role gone when it runs again.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref

from ascendstore.local import _shmpool

log = logging.getLogger(__name__)

#: stretches per native call: bounds how long close() waits for the thread (~5 ms a
#: stretch where the hypervisor backs fresh memory, as measured)
_STEP = 8
#: the wait after catching up with the fill, doubled while nothing new is used
_IDLE_MIN_S, _IDLE_MAX_S = 0.02, 0.5
#: the wait while another process does the work: how soon one takes over from a process gone
_OTHER_S = 2.0
#: a process alive but not stepping this long while it holds the role (stopped: SIGSTOP, a
#: paused container) has the role taken from it; a holder steps at least every _IDLE_MAX_S
_STALE_S = 10.0

#: the thread's nice value (Linux: per thread)
_NICE = 10

# collapse_step's states the thread tells apart (1: the whole arena done, 2: the pool
# closed, end it as well)
_CAUGHT_UP, _NOT_HERE, _OTHER = 0, -1, 3


class HugePageFiller:
    """A thread making 2 MiB pages of the arena ahead of the pool's fill, while no
    other process of the pool does (``filling``)."""

    def __init__(self, pool: _shmpool.Pool, name: str) -> None:
        # (a weak reference: a pool nobody holds any more is freed, and the thread ends)
        self._pool = weakref.ref(pool)
        self._name = name
        self._stop = False
        self._wake = threading.Event()
        self._cond = threading.Condition()
        self.made = 0  # stretches made 2 MiB pages
        self.idle_waits = 0  # waits after catching up with the fill
        self.state: int | None = None  # the last step's state
        self.filling = False  # this process does the work now (it took the role)
        self._steps = self._idle_step = 0
        self._in_step = False
        self._thread = threading.Thread(target=self._run, name=f"ascendstore-hugefill-{name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        idle, cursor = _IDLE_MIN_S, 0
        try:  # background work: the engine's own threads come first while the pool fills
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), _NICE)
        except OSError:
            pass
        try:
            while not self._stop:
                with self._cond:
                    self._in_step = True
                pool = self._pool()
                if pool is None:
                    return
                try:
                    # (only this thread steps: the cursor is the handle's own)
                    made, at, state = pool.collapse_step(_STEP, _STALE_S)
                    filling = pool.filling
                except Exception:  # never takes the pool down: it just stays in 4 KiB pages
                    log.exception("local pool %r: making 2 MiB pages as it fills failed; it goes on in 4 KiB "
                                  "pages", self._name)
                    return
                finally:
                    del pool
                with self._cond:
                    self._in_step = False
                    self.made += made
                    self.state = state
                    if filling and not self.filling:
                        log.debug("local pool %r: this process makes its 2 MiB pages as it fills", self._name)
                    self.filling = filling
                    self._steps += 1
                    moved, cursor = at != cursor, at
                    if not moved or state != _CAUGHT_UP:
                        self._idle_step = self._steps
                    self._cond.notify_all()
                if state == _NOT_HERE and not self.made:
                    log.info("local pool %r: the kernel makes no 2 MiB pages of /dev/shm files here "
                             "(MADV_COLLAPSE, Linux 6.1+); the pool fills in 4 KiB pages", self._name)
                if state == _OTHER:  # another live process does the work: look again later
                    self._wake.wait(_OTHER_S)
                    self._wake.clear()
                    continue
                if state != _CAUGHT_UP:
                    return
                if moved:
                    idle = _IDLE_MIN_S
                    continue
                self.idle_waits += 1
                self._wake.wait(idle)
                self._wake.clear()
                idle = min(idle * 2, _IDLE_MAX_S)
        finally:
            self._give_up()
            with self._cond:
                self._cond.notify_all()

    def _give_up(self) -> None:
        """The thread ends: the role goes to the next process that asks (closing does it too)."""
        pool = self._pool()
        if pool is None or not self.filling:
            return
        try:
            pool.collapse_release()
        except Exception:
            log.exception("local pool %r: giving up making its 2 MiB pages failed", self._name)
        self.filling = False

    def caught_up(self, timeout_s: float = 30.0) -> bool:
        """Wait until a step begun after this call found nothing left to do (the
        thread has caught up with the fill, or another process does the work), or
        the thread ended (tests, bench)."""
        with self._cond:
            since = self._steps + (1 if self._in_step else 0)  # (a step under way began before)
        self._wake.set()
        with self._cond:
            return self._cond.wait_for(lambda: self._idle_step > since or not self._thread.is_alive(), timeout_s)

    def stop(self) -> None:
        """Before the pool is closed: the thread ends within one step."""
        self._stop = True
        self._wake.set()
        if self._thread is not threading.current_thread():
            self._thread.join()
