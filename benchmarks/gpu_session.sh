#!/bin/sh
# One GPU-machine session after the MLX CUDA wheel is installed in /root/site (see ../shared/GPU.md):
# fused kernel tests, the kernel variants and host cost (gpu_mma.py), then the bench (attention and
# end to end). Results go to $OUT.
export PYTHONPATH=/root/site:$PWD
OUT=${OUT:-out}
DEVICE=gpu python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py -k "fused or single_launch" 2>&1 | tail -3 | tee $OUT/kernel-tests.log
python3 benchmarks/gpu_mma.py $OUT 2>&1 | tee $OUT/gpu_mma.log | tail -12
python3 -m cartridge.cli.main bench --contexts 32768,65536,131072 --tiers fp16,mlx4g32,turbo4 --e2e-tiers mlx4g32 \
  --json $OUT/h200-bench.json --plot $OUT/h200-bench.png > $OUT/h200-bench.log 2>&1
tail -32 $OUT/h200-bench.log
