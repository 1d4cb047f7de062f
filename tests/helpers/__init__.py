"""What the tests share that is not a pytest fixture (fixtures are in tests/conftest.py): tiny models
(`tiny_models`), the sample document (`samples`), synthetic and damaged cartridges (`cartfiles`), running the
command line (`clirun`), the subprocess workers the tests start by path (`*_worker.py`, `crash_writer.py`),
references the tests compare against, and the golden vectors (`vectors/`).

Imported as `helpers.NAME`: pytest puts tests/ on sys.path (pyproject.toml's `pythonpath`); a worker run by path
puts it there itself. No test file imports another test file, or conftest.py (tests/system/test_layout.py).
"""

from pathlib import Path

HELPERS = Path(__file__).resolve().parent  # tests/helpers/: the workers are run by path from here
VECTORS = HELPERS / "vectors"
ROOT = HELPERS.parents[1]  # the repository
