"""`cartridge serve` ends within seconds of one Ctrl-C while an answer streams: uvicorn waits
`SHUTDOWN_GRACE_S` for the open responses, then cancels them (its default waits for every connection)."""

import http.client
import json
import signal
import threading
import time

import cartridge  # noqa: F401, I001  (first: loads OpenBLAS before mlx)
import pytest
from helpers.servers import start_server

from cartridge.serve import SHUTDOWN_GRACE_S


def _stream(port, started, chunks):
    """A streaming chat request of many tokens; `started` set at its first chunk; read until the server ends it."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    body = {"model": "default_model", "messages": [{"role": "user", "content": "Write the numbers from 1 to 5000, one per line."}],
            "max_tokens": 3000, "stream": True, "temperature": 0}
    try:
        c.request("POST", "/v1/chat/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        r = c.getresponse()
        while line := r.readline():
            chunks.append(line)
            started.set()
    except (OSError, http.client.HTTPException):
        pass
    finally:
        c.close()


@pytest.mark.slow
def test_one_ctrl_c_while_an_answer_streams_ends_the_server_within_seconds(tmp_path):
    """The default model (SmolLM2-135M): 3000 tokens stream for a minute or more on a CPU (a tiny random model
    answers them in a second or two, before any signal could wait for it)."""
    proc, port = start_server([tmp_path, "--model", "default"], tmp_path / "serve.log")
    started, chunks = threading.Event(), []
    reader = threading.Thread(target=_stream, args=(port, started, chunks), daemon=True)
    reader.start()
    assert started.wait(60)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    try:
        rc = proc.wait(timeout=SHUTDOWN_GRACE_S + 20)
    finally:
        proc.kill()
    took = time.monotonic() - t0
    log = (tmp_path / "serve.log").read_text()
    assert rc == 0 and took < SHUTDOWN_GRACE_S + 10, (took, log[-2000:])
    assert "Traceback" not in log and len(chunks) < 3000, log[-3000:]
