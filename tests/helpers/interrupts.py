"""Running the `cartridge` command line in helpers/interrupt_worker.py, which pauses at a stage so a test can send
SIGINT there (tests/system/test_cli_interrupt.py, test_cli_chat.py)."""

import os
import subprocess
import sys
import time

from helpers import HELPERS

WORKER = HELPERS / "interrupt_worker.py"


def start(stage, *args, flag, stdin=subprocess.DEVNULL):
    """The worker running `cartridge ARGS...` with a pause at `stage`; it writes `flag` when there."""
    env = dict(os.environ, INTERRUPT_FLAG=str(flag))
    return subprocess.Popen([sys.executable, str(WORKER), stage, *map(str, args)], env=env, stdin=stdin,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def wait_for(flag, proc, timeout=120):
    """Wait until the worker reached its pause (`flag` written), then remove the flag."""
    end = time.monotonic() + timeout
    while not flag.exists():
        assert proc.poll() is None, proc.communicate()[1].decode()
        assert time.monotonic() < end, "the worker never reached its pause"
        time.sleep(0.02)
    flag.unlink()
