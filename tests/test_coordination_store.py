"""jaxcomm's own coordination store (``jaxcomm.distributed``), which barriers and exchanges
between processes use: two clients in threads of this process, on loopback. The store in a
real multi-process job: tests/test_launch.py (barrier, agree, exchange, a dead peer)."""

import socket
import sys
import threading
import time

import pytest

from jaxcomm import distributed


@pytest.fixture
def store():
    server = distributed._StoreServer(2, "127.0.0.1")
    clients = [distributed._StoreClient(("127.0.0.1", server.port), p, 10) for p in (0, 1)]
    yield clients
    for c in clients:
        c.file.close()
        c.sock.close()


def in_thread(fn):
    out: dict = {}

    def run():
        try:
            out["value"] = fn()
        except Exception as e:  # noqa: BLE001 (reported to the test)
            out["error"] = e

    t = threading.Thread(target=run)
    t.start()
    return t, out


def test_a_barrier_waits_for_every_process_and_values_are_read_by_all(store):
    first, second = store
    t, out = in_thread(lambda: distributed._barrier(first, "b", 30))
    time.sleep(0.2)
    assert t.is_alive()  # process 1 has not arrived
    distributed._barrier(second, "b", 30)
    t.join(10)
    assert not t.is_alive() and "error" not in out, out
    first.request({"op": "set", "key": "k/0", "value": "zero"})
    got = second.request({"op": "get", "key": "k/0", "timeout_s": 5})
    assert got == "zero"


def test_a_process_that_is_gone_fails_the_wait_at_once(store):
    first, second = store
    t, out = in_thread(lambda: distributed._barrier(first, "b", 600))
    time.sleep(0.2)
    second.sock.shutdown(socket.SHUT_RDWR)  # process 1 exits or is killed: its end closes
    t.join(10)
    assert not t.is_alive()
    assert isinstance(out.get("error"), RuntimeError), out
    assert "processes [1] are gone" in str(out["error"])


def test_a_barrier_that_not_every_process_reaches_times_out(store):
    first, _ = store
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"barrier 'b': not every process arrived within 1 s"):
        distributed._barrier(first, "b", 1)
    assert time.monotonic() - t0 < 10


def test_a_store_that_is_gone_is_named():
    """Process 0 exits: its end of every connection closes."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve_hello_then_exit():
        conn, _ = listener.accept()
        with conn, conn.makefile("rw") as f:
            f.readline()
            f.write('{"ok": null}\n')
            f.flush()

    t = threading.Thread(target=serve_hello_then_exit)
    t.start()
    client = distributed._StoreClient(listener.getsockname(), 1, 10)
    t.join(10)
    with pytest.raises(RuntimeError, match="process 0, which serves the coordination store"):
        client.request({"op": "get", "key": "k", "timeout_s": 1})
    listener.close()


_PLAIN_INITIALIZE = """
import os
import jax
jax.config.update("jax_num_cpu_devices", int(os.environ["JAXCOMM_LOCAL_DEVICES"]))
jax.distributed.initialize(
    os.environ["JAXCOMM_COORDINATOR"],
    int(os.environ["JAXCOMM_NUM_PROCESSES"]),
    int(os.environ["JAXCOMM_PROCESS_ID"]),
)
from jaxcomm import distributed
me = jax.process_index()
distributed.barrier("plain start")
errors = distributed.agree("plain work", None if me == 0 else "bad file")
print("AGREED", errors, flush=True)
"""


def test_a_job_started_by_jax_distributed_alone_gets_the_store_at_its_first_barrier():
    from helpers import launch_two_processes

    out = launch_two_processes(sys.executable, "-c", _PLAIN_INITIALIZE, timeout=180)
    assert out.count("AGREED [None, 'bad file']") == 2, out[-3000:]
