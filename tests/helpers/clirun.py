"""Running `cartridge ARGS` in the CLI tests: as a real process, or in this one.

A real process (`python -m cartridge.cli.main`) pays an interpreter start and the imports of MLX, mlx-lm and
transformers each time: about 5 s of CPU for an `ask` on the tiny model, against about 1 s in-process (measured on
the 2-core test machine). So the tests about what a command says and writes run it in-process, through the same
`main` the console script calls; each command keeps at least one real-process test (the process's own exit status
and every byte it writes, a library's logging included), and every Ctrl-C, crash and concurrency test stays real.
"""

import subprocess
import sys

from click.testing import CliRunner

# the CLI tests' document: the `built` fixture (tests/conftest.py) builds DOC x 3 with a real `cartridge build`
DOC = "The tenant may terminate this lease with 60 days of notice. Rent is 900 euros a month.\n"


def run_process(*args, stdin=None, text=False, timeout=300, **kw):
    """`cartridge ARGS` as a real process: a subprocess.CompletedProcess (stdout/stderr bytes, or str if text)."""
    return subprocess.run([sys.executable, "-m", "cartridge.cli.main", *map(str, args)], input=stdin,
                          capture_output=True, text=text, timeout=timeout, **kw)


def run_inprocess(*args, stdin=None, text=False):
    """`cartridge ARGS` through `cartridge.cli.main.main` in this process, stdin/stdout/stderr swapped for
    buffers (click's CliRunner isolation): a subprocess.CompletedProcess as `run_process` gives.

    Exit status: that of the SystemExit `main` raises (0 when it returns). An exception `main` does not turn
    into an error line propagates (the test fails with its traceback, where a process would exit 1).
    """
    from cartridge.cli.main import main

    argv = [str(a) for a in args]
    with CliRunner().isolation(input=stdin.encode() if isinstance(stdin, str) else stdin) as (out, err, _):
        try:
            main(argv)
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        sys.stdout.flush()
        sys.stderr.flush()
        stdout, stderr = out.getvalue(), err.getvalue()
    if text:
        stdout, stderr = stdout.decode(), stderr.decode()
    return subprocess.CompletedProcess(["cartridge", *argv], code, stdout, stderr)
