"""Running `cartridge serve` as a real process in the serve tests: a free 127.0.0.1 port, a bounded wait
until it answers, raw HTTP requests. Every server the tests start listens on 127.0.0.1 only."""

import http.client
import socket
import subprocess
import sys
import time


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def raw(port, method, path, body=None, headers=None):
    """(status, body bytes) of one request; `headers` default to a JSON content type."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        c.request(method, path, body=body, headers=headers or {"Content-Type": "application/json"})
        r = c.getresponse()
        return r.status, r.read()
    finally:
        c.close()


def wait_ready(proc, port, timeout=180):
    """True once GET /v1/models answers 200; False (the process killed) if it exits or `timeout` passes."""
    t0 = time.time()
    while time.time() - t0 < timeout and proc.poll() is None:
        try:
            if raw(port, "GET", "/v1/models")[0] == 200:
                return True
        except OSError:
            time.sleep(0.3)
    proc.kill()
    proc.wait()
    return False


def start_server(args, log, attempts=3):
    """`cartridge serve ARGS --port P` on a free port, its output in the file `log`.

    Returns:
        tuple: (Popen, port).

    Raises:
        RuntimeError: it did not start (the log's text in the message).
    """
    for _ in range(attempts):  # another process may take the free port between the probe and the bind
        port = free_port()
        with open(log, "a") as out:
            proc = subprocess.Popen([sys.executable, "-m", "cartridge.cli.main", "serve", *map(str, args),
                                     "--port", str(port)], stdout=out, stderr=out)
        if wait_ready(proc, port):
            return proc, port
    raise RuntimeError(f"the server did not start:\n{open(log).read()}")


def stop(proc):
    """SIGTERM, then wait (bounded) for the process to end."""
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
