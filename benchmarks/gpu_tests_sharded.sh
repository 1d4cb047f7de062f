#!/bin/sh
# The CUDA kernel tests on the GPU machine in SHARDS parallel pytest processes (kernel compiles by NVRTC are
# CPU-bound; the machine has 16 cores): node ids split round-robin, one log per shard, a summary last.
export PYTHONPATH=/root/site:$PWD CARTRIDGE_TEST_TOKENIZER=/root/gpu/tok DEVICE=gpu
OUT=${OUT:-out}; SHARDS=${SHARDS:-8}; LIMIT=${LIMIT:-480}
FILES="tests/test_kernels.py tests/test_tail_boundaries.py tests/test_protect.py tests/test_backends.py"
if [ -n "$IDS" ]; then cp "$IDS" /tmp/ids; else  # IDS: a file of node ids to run instead of all of FILES
  python3 -m pytest -q -p no:cacheprovider -m "not slow" --collect-only $FILES | grep '::' > /tmp/ids; fi
wc -l < /tmp/ids
i=0; while [ $i -lt $SHARDS ]; do
  awk -v n=$SHARDS -v i=$i 'NR % n == i' /tmp/ids > /tmp/shard$i
  tr "\n" "\0" < /tmp/shard$i | timeout $LIMIT xargs -0 python3 -m pytest -q -p no:cacheprovider -m "not slow" > /tmp/shard$i.log 2>&1 &
  i=$((i+1)); done
wait
i=0; while [ $i -lt $SHARDS ]; do echo "== shard $i"; cat /tmp/shard$i.log; i=$((i+1)); done > $OUT/h200-seam-kernel-tests.log
grep -h -E '^(FAILED|ERROR)|passed|failed' $OUT/h200-seam-kernel-tests.log
