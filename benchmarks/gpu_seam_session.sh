#!/bin/sh
# One GPU-machine session for issue 30's CUDA target and issue 34 item 1 (MLX's CUDA wheel installed in
# /root/site, the default model's tokenizer saved in /root/gpu/tok; see ../shared/GPU.md): the kernel tests
# on the GPU, the bench of every tier at 32K/128K (fused, dequantize-once), then gpu_fp16_gap.py.
export PYTHONPATH=/root/site:$PWD CARTRIDGE_TEST_TOKENIZER=/root/gpu/tok PYTHONUNBUFFERED=1
OUT=${OUT:-out}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv > $OUT/nvidia-smi.txt 2>&1
python3 -m cartridge.cli.main bench --contexts 32768,131072 --policies fused,dequantize-once --no-e2e \
  --query-tokens none --json $OUT/h200-bench-seam.json > $OUT/h200-bench-seam.log 2>&1
python3 benchmarks/gpu_fp16_gap.py $OUT > $OUT/h200-fp16-gap.log 2>&1
DEVICE=gpu timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q -p no:cacheprovider -m "not slow" tests/test_kernels.py \
  tests/test_tail_boundaries.py tests/test_protect.py tests/test_backends.py > $OUT/h200-seam-kernel-tests.log 2>&1
echo "tests rc=$?"; tail -4 $OUT/h200-seam-kernel-tests.log
grep -A40 '^gate' $OUT/h200-bench-seam.log | head -40
cat $OUT/h200-fp16-gap.log | tail -32
