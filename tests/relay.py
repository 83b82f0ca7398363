"""A gated byte relay between two peers, for faults that must land while a transfer's bytes flow.

A loopback TCP relay in the test process: every connection a dialler makes to ``relay.port`` is
relayed to the acceptor at ``target_port``, byte for byte (it knows nothing of the wire format).
It counts what it forwarded in each direction and can hold one direction after a budget of bytes,
so a test can *see* a transfer in flight, and know it cannot have completed, when it kills or
freezes a peer::

    relay = Relay(prompt_port)
    decode.call(kv.link, PROMPT_ID, relay.port)          # over tcp: a same-host path would route around it
    relay.hold_after(DOWN, 1 << 20)                       # let 1 MiB of the acceptor's answers through
    ...start a 32 MiB pull in the background...
    relay.wait_held()                                     # the pull's bytes are flowing, and stopped here
    prompt.kill()
    relay.release()                                       # what was sent before the death goes on; then EOF

When one side of a connection ends, the relay forwards what it had already read and closes the
other side: a dead peer looks to the survivor exactly as a dead peer does on a direct connection.
Everything is bounded: no relay thread waits longer than ``TIMEOUT_S`` for anything.

No thread closes a socket another thread may be blocked on: CPython's ``close`` clears the
descriptor while a blocked ``recv`` on another thread reads it (a data race ThreadSanitizer
reports, and the number may be reused). Other threads only shut a socket down, which wakes the
blocked call; the thread that uses it last closes it (:class:`Conn`).
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from functools import partial

from poll import wait_until

UP, DOWN = 0, 1  # dialler -> acceptor, acceptor -> dialler
TIMEOUT_S = 30.0
_CHUNK = 1 << 16


class Relay:
    def __init__(self, target_port: int):
        self.target_port = target_port
        self.forwarded = [0, 0]  # bytes forwarded per direction, over all connections
        self._granted = [0, 0]  # bytes a pump took budget for (forwarded once its send returns)
        self._cond = threading.Condition()
        self._budget: list[int | None] = [None, None]  # bytes still allowed through; None: unlimited
        self._held = [False, False]  # a pump is waiting for budget
        self._conns: list[Conn] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._acceptor = threading.Thread(target=self._accept, name="relay-accept", daemon=True)
        self._acceptor.start()

    # ------------------------------------------------------------------ control (test thread)

    def hold_after(self, direction: int, nbytes: int) -> None:
        """From now on at most ``nbytes`` more bytes go through in ``direction``; then it holds."""
        with self._cond:
            self._budget[direction] = nbytes
            self._cond.notify_all()

    def wait_held(self, direction: int = DOWN) -> int:
        """Waits until ``direction`` has used its budget and has more to send (a transfer is in
        flight and stopped at the relay), and every byte let through has been sent on (with several
        connections, another pump may still be sending its last grant); returns the bytes forwarded
        that way so far."""

        def held() -> bool:
            with self._cond:
                return self._held[direction] and self.forwarded[direction] == self._granted[direction]

        wait_until(held, TIMEOUT_S, "the relay holding bytes in flight")
        return self.forwarded[direction]

    def release(self) -> None:
        """Lifts every hold."""
        with self._cond:
            self._budget = [None, None]
            self._cond.notify_all()

    def ended(self) -> bool:
        """Whether every connection the relay took has ended (both its threads returned)."""
        return all(not t.is_alive() for conn in list(self._conns) for t in conn._threads)

    def connections(self) -> int:
        """How many connections the relay has taken so far."""
        return len(self._conns)

    def cut(self, index: int) -> None:
        """Ends connection ``index`` (in the order they came) at once, both ways: to each side it
        looks like the other side went away."""
        self._conns[index].shut()

    def close(self) -> None:
        """Ends every connection and the listener, and waits (bounded) for the relay's threads."""
        self.release()
        shut_quietly(self._listener)
        self._acceptor.join(TIMEOUT_S)
        for conn in self._conns:
            conn.close()

    def __enter__(self) -> Relay:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ threads

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:  # close() shut the listener down
                self._listener.close()
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port), timeout=TIMEOUT_S)
            except OSError:
                close_quietly(client)
                continue
            client.settimeout(TIMEOUT_S)
            conn = Conn(client, upstream)
            self._conns.append(conn)
            conn.start(partial(self._pump, UP, client, upstream), partial(self._pump, DOWN, upstream, client))

    def _take(self, direction: int, want: int) -> int:
        """Waits for budget in ``direction``; how many of ``want`` bytes may go now (0: timed out)."""
        with self._cond:
            while self._budget[direction] == 0:
                self._held[direction] = True
                if not self._cond.wait(TIMEOUT_S):
                    return 0
            self._held[direction] = False
            budget = self._budget[direction]
            n = want if budget is None else min(want, budget)
            if budget is not None:
                self._budget[direction] = budget - n
            self._granted[direction] += n
            return n

    def _pump(self, direction: int, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(_CHUNK):
                view = memoryview(data)
                while view:
                    n = self._take(direction, len(view))
                    if n == 0:
                        return
                    dst.sendall(view[:n])
                    view = view[n:]
                    with self._cond:
                        self.forwarded[direction] += n
        except OSError:
            pass
        # returning ends the connection: the other side learns of it as it would without the relay


class Conn:
    """Two sockets served by two threads (one reading each). When either thread ends, both
    sockets are shut down, which wakes the other thread; the last of the two to end closes them."""

    def __init__(self, a: socket.socket, b: socket.socket):
        self.socks = (a, b)
        self._threads: list[threading.Thread] = []
        self._live = 2
        self._lock = threading.Lock()

    def start(self, *work: Callable[[], None]) -> None:
        for fn in work:
            t = threading.Thread(target=self._run, args=(fn,), daemon=True)
            self._threads.append(t)
            t.start()

    def _run(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        finally:
            self.shut()
            with self._lock:
                self._live -= 1
                last = self._live == 0
            if last:
                for s in self.socks:
                    s.close()

    def shut(self) -> None:
        for s in self.socks:
            shut_quietly(s)

    def close(self) -> None:
        """Ends the connection from another thread and waits (bounded) for its threads."""
        self.shut()
        for t in self._threads:
            t.join(TIMEOUT_S)


def shut_quietly(s: socket.socket) -> None:
    """Shuts ``s`` down both ways (the peer sees the end at once, a blocked call on it returns);
    never raises. Safe from any thread, unlike close."""
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def close_quietly(s: socket.socket) -> None:
    """Shuts ``s`` down and closes it, for a socket no other thread uses; never raises."""
    shut_quietly(s)
    s.close()
