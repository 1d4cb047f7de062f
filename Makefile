# Two commands on a fresh machine:  make demo   (set up, build the sample, inspect, ask)
#                                   make test   (set up, run the test suite)
VENV ?= .venv
BIN := $(VENV)/bin
SAMPLE := samples/lgpl-3.0.txt
CART := out/lgpl-3.0.cart
QUESTION := Who publishes revised versions of the GNU Lesser General Public License?

TIERS ?= fp16,bf16

.PHONY: setup demo test test-slow test-all test-families bench bench-tiers eval clean

$(BIN)/cartridge: pyproject.toml scripts/setup.sh
	scripts/setup.sh
	@touch $@

setup: $(BIN)/cartridge

demo: setup
	@mkdir -p out
	$(BIN)/cartridge build $(SAMPLE) -o $(CART) --force
	$(BIN)/cartridge inspect $(CART)
	$(BIN)/cartridge ask $(CART) "$(QUESTION)" --max-tokens 60

test: setup
	$(BIN)/python -m pytest -q -m "not slow and not families"

test-slow: setup
	$(BIN)/python -m pytest -q -m "slow and not families"

test-all: setup
	$(BIN)/python -m pytest -q -m "not families"

test-families: setup
	$(BIN)/python -m pytest -q -m families

bench: setup
	$(BIN)/python benchmarks/ttft.py --json out/ttft.json

eval: setup
	@mkdir -p out
	$(BIN)/cartridge eval $(SAMPLE) --questions samples/lgpl-3.0.questions.jsonl --tiers $(TIERS) \
		--json out/eval.json --plot out/eval.png --work-dir out/eval-work --markdown --force

bench-tiers: setup
	$(BIN)/python benchmarks/tiers.py --json out/tiers.json

clean:
	rm -rf out .pytest_cache
