#!/bin/sh
# One GPU-machine session (MLX's CUDA wheel installed in /root/site, the default model's tokenizer saved in
# /root/gpu/tok; see ../shared/GPU.md), everything in one device call, results under $OUT:
#   1. nvidia-smi (clocks, temperature) -> nvidia-smi.txt;
#   2. `dense`: `gpu_floor.py --part dense` (dense pages against MLX's SDPA) -> $LABEL-dense.{json,log}; `floors`: its
#      `--part floors` (each tier's bare read) -> $LABEL-floors.{json,log}; `e2e`: its `--part e2e` (decode
#      tokens/s, fp16 contiguous and flash) -> $LABEL-e2e.{json,log};
#   3. `bench`: `cartridge bench` of every tier at 32K/128K, fused and dequantize-once, questions of QUERY tokens
#      (default none) -> $LABEL-bench-$TAG.{json,log};
#   4. `tests`: the CUDA kernel tests (DEVICE=gpu, not slow, -k $K if set) in SHARDS parallel pytest processes
#      (kernel compiles by NVRTC are CPU-bound; the machine has 16 cores): node ids split round-robin, one log
#      per shard, all shards in $LABEL-$TAG-kernel-tests.log, a summary last.
#   5. `k4`: the fused float64 checks of issue 34 item 4 (sinks, +rot, TurboQuant, kivi4, protected tokens, the
#      question prefill's CUDA decode; -k $K4) in one pytest with -n 16 (pytest-xdist), each test named (-rA) in
#      $LABEL-$TAG-kernel-tests.log; `profile`: Nsight Compute (--set full) of two fused decode steps each of mlx4g32
#      and turbo3 at 128K (`gpu_floor.py --part profile`) -> $LABEL-ncu.ncu-rep, its details page $LABEL-ncu.txt;
#      `sweep` / `prefill` / `questions`: `gpu_floor.py --part sweep|prefill|questions` -> $LABEL-sweep.*, ...;
#      `real`: the default model's answers over an fp16 cartridge vs a fresh prefill (tests/system/test_real_model.py and
#      tests/attention/test_generate_loop.py, slow, DEVICE=gpu) -> $LABEL-$TAG-real-model.log; `final`: `cartridge bench` of the
#      tiers in TIERS, attention and end to end (llama3-8b) at 32K/128K, one group a call -> $LABEL-final-$TAG.*.
# STEPS picks steps (default "dense bench tests"); TAG names the files (default seam); LABEL prefixes them (h200); IDS: a file of node ids to
# run instead of all of FILES; SHARDS (default 8); LIMIT: seconds per shard (default 480).
export PYTHONPATH=/root/site:$PWD CARTRIDGE_TEST_TOKENIZER=/root/gpu/tok PYTHONUNBUFFERED=1
LABEL=${LABEL:-h200}  # the files' prefix: the card and session (h100-s7)
OUT=${OUT:-out}; SHARDS=${SHARDS:-8}; LIMIT=${LIMIT:-480}; STEPS=${STEPS:-dense bench tests}; TAG=${TAG:-seam}
FILES=${FILES:-tests/attention/test_kernels.py tests/attention/test_tail_boundaries.py tests/tiers/test_protect.py tests/attention/test_backends.py}
mkdir -p $OUT
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv > $OUT/nvidia-smi.txt 2>&1
case " $STEPS " in *" dense "*)
  python3 benchmarks/gpu_floor.py --part dense --label $LABEL $OUT > $OUT/$LABEL-dense.log 2>&1
  tail -40 $OUT/$LABEL-dense.log;; esac
for part in floors e2e; do case " $STEPS " in *" $part "*)
  python3 benchmarks/gpu_floor.py --part $part --label $LABEL $OUT > $OUT/$LABEL-$part.log 2>&1
  tail -12 $OUT/$LABEL-$part.log;; esac; done
case " $STEPS " in *" bench "*)
  python3 -m cartridge.cli.main bench --contexts 32768,131072 --policies fused,dequantize-once --no-e2e \
    --query-tokens ${QUERY:-none} --repeats ${REPEATS:-20} --json $OUT/$LABEL-bench-$TAG.json > $OUT/$LABEL-bench-$TAG.log 2>&1
  grep -A40 '^gate' $OUT/$LABEL-bench-$TAG.log | head -40;; esac
case " $STEPS " in *" bench-e2e "*)  # E2E_TIERS decoded end to end (llama3-8b shape, fused) at 32K and 128K
  python3 -m cartridge.cli.main bench --contexts 32768,131072 --policies fused --tiers ${E2E_TIERS:-fp16,int8} \
    --e2e-shape llama3-8b --e2e-contexts 32768,131072 --query-tokens none --repeats 10 \
    --json $OUT/$LABEL-e2e-$TAG.json > $OUT/$LABEL-e2e-$TAG.log 2>&1
  tail -30 $OUT/$LABEL-e2e-$TAG.log;; esac
case " $STEPS " in *" final "*)  # one group of TIERS: attention (fused, dequantize-once; decode and QUERY-token questions)
  # and end to end (llama3-8b shape) at 32K and 128K, each call with its own dense baselines
  python3 -m cartridge.cli.main bench --contexts 32768,131072 --policies fused,dequantize-once --tiers $TIERS \
    --e2e-shape llama3-8b --e2e-contexts 32768,131072 --query-tokens ${QUERY:-32,256} --repeats ${REPEATS:-10} \
    --json $OUT/$LABEL-final-$TAG.json > $OUT/$LABEL-final-$TAG.log 2>&1
  grep -v '^bench:' $OUT/$LABEL-final-$TAG.log | tail -90;; esac
K4=${K4:-(fused_cuda and (rot or turbo or kivi4 or sinks or protected)) or question_prefill_cuda or single_launch}
case " $STEPS " in *" k4 "*)
  DEVICE=gpu timeout ${LIMIT_K4:-170} python3 -m pytest -q -rA -p no:cacheprovider -n 16 -m "not slow" \
    tests/attention/test_kernels.py -k "$K4" > $OUT/$LABEL-$TAG-kernel-tests.log 2>&1
  grep -h -E '^(FAILED|ERROR)|passed|failed' $OUT/$LABEL-$TAG-kernel-tests.log | tail -40;; esac
case " $STEPS " in *" profile "*)
  PATH=$PATH:/usr/local/cuda/bin timeout 150 ncu --set full -k regex:"cartridge_(mma|tc)" -c 4 -f -o $OUT/$LABEL-ncu \
    python3 benchmarks/gpu_floor.py --part profile /tmp > /tmp/ncu.log 2>&1
  tail -5 /tmp/ncu.log
  { cat /tmp/ncu.log; PATH=$PATH:/usr/local/cuda/bin ncu --import $OUT/$LABEL-ncu.ncu-rep --page details; } \
    > $OUT/$LABEL-ncu.txt 2>&1;; esac
for part in sweep prefill questions; do case " $STEPS " in *" $part "*)
  timeout ${LIMIT_PART:-200} python3 benchmarks/gpu_floor.py --part $part --label $LABEL $OUT > $OUT/$LABEL-$part.log 2>&1
  tail -3 $OUT/$LABEL-$part.log;; esac; done
case " $STEPS " in *" real "*)
  DEVICE=gpu timeout ${LIMIT_REAL:-240} python3 -m pytest -q -rA -p no:cacheprovider -m "slow or not slow" tests/system/test_real_model.py \
    tests/attention/test_generate_loop.py > $OUT/$LABEL-$TAG-real-model.log 2>&1
  grep -h -E '^(PASSED|FAILED|ERROR)|passed|failed' $OUT/$LABEL-$TAG-real-model.log | tail -30;; esac
case " $STEPS " in *" tests "*)
  if [ -n "$IDS" ]; then cp "$IDS" /tmp/ids; else
    DEVICE=gpu python3 -m pytest -q -p no:cacheprovider -m "not slow" ${K:+-k "$K"} --collect-only $FILES |
      grep '::' > /tmp/ids; fi
  wc -l < /tmp/ids
  i=0; while [ $i -lt $SHARDS ]; do
    awk -v n=$SHARDS -v i=$i 'NR % n == i' /tmp/ids > /tmp/shard$i
    tr "\n" "\0" < /tmp/shard$i | DEVICE=gpu timeout $LIMIT xargs -0 python3 -m pytest -q -p no:cacheprovider \
      -m "not slow" > /tmp/shard$i.log 2>&1 &
    i=$((i+1)); done
  wait
  i=0; while [ $i -lt $SHARDS ]; do echo "== shard $i"; cat /tmp/shard$i.log; i=$((i+1)); done \
    > $OUT/$LABEL-$TAG-kernel-tests.log
  grep -h -E '^(FAILED|ERROR)|passed|failed' $OUT/$LABEL-$TAG-kernel-tests.log;; esac
