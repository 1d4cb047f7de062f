"""Subprocess used by tests/system/test_cli_interrupt.py: run the `cartridge` command line with a pause at one
stage, so the parent can send SIGINT there. At the pause it writes "ready" to the file $INTERRUPT_FLAG.

    python tests/helpers/interrupt_worker.py prefill|calibrate|write|answer|first|none cartridge-arguments...

prefill: after the first prefill chunk (build, extend; give a small --prefill-step). calibrate: after the
first layer of calibration's walk (build with a budget preset). write: after the
first extent is written into the temporary directory (build, extend, convert). answer: every generated
token of `chat` takes 50 ms, and the pause is the third token of each answer (it goes on, slowly). first:
the pause is before each answer's first token is shown (it comes 2 s later). none: no pause.
"""

import importlib
import os
import sys
import time
from pathlib import Path

import cartridge  # noqa: F401, I001  (first: loads OpenBLAS before mlx)

FLAG = Path(os.environ["INTERRUPT_FLAG"])


def pause():
    FLAG.write_text("ready")
    time.sleep(60)  # SIGINT raises KeyboardInterrupt here


def pausing(progress):
    """A progress callback that passes calls on to `progress` and pauses after the first step."""
    def report(done, total):
        if progress:
            progress(done, total)
        if done:
            pause()
    return report


def pause_in_prefill():
    prefill = importlib.import_module("cartridge.write.prefill")
    feed = prefill._feed
    prefill._feed = lambda model, tokens, step, progress, caches: feed(model, tokens, step, pausing(progress), caches)


def pause_in_calibration():
    from cartridge.calibrate import measure

    walk = measure.wavefront
    measure.wavefront = lambda model, probe, candidates, out, progress=None: walk(model, probe, candidates, out,
                                                                                   pausing(progress))


def pause_in_write():
    from cartridge.format.writer import CartridgeWriter

    add = CartridgeWriter.add_extent

    def paused(self, *args):
        add(self, *args)
        pause()

    CartridgeWriter.add_extent = paused


def slow_answers():
    import mlx_lm

    generate = mlx_lm.stream_generate

    def slow(*args, **kwargs):
        for i, r in enumerate(generate(*args, **kwargs)):
            yield r
            if i == 2:
                FLAG.write_text("ready")
            time.sleep(0.05)

    mlx_lm.stream_generate = slow


def slow_first_token():
    """Each answer's first token arrives 2 s late, after the pause: Ctrl-C lands while it is computed."""
    import mlx_lm

    generate = mlx_lm.stream_generate

    def slow(*args, **kwargs):
        for i, r in enumerate(generate(*args, **kwargs)):
            if i == 0:
                FLAG.write_text("ready")
                time.sleep(2)  # a SIGINT handler that only sets a flag lets the sleep go on (PEP 475)
            yield r

    mlx_lm.stream_generate = slow


if __name__ == "__main__":
    {"prefill": pause_in_prefill, "calibrate": pause_in_calibration, "write": pause_in_write, "answer": slow_answers, "first": slow_first_token,
     "none": lambda: None}[sys.argv[1]]()
    from cartridge.cli.main import main

    main(sys.argv[2:])
