"""End-to-end decode on the GPU machine: the fused path with one launch per layer and with two,
interleaved with the dense baseline (Llama-3.2-1B shape, random fp16 weights, mlx4g32 cartridge, 32K
prefix, best of 3 rounds of 32 tokens, 2 passes).   python3 benchmarks/gpu_e2e_variants.py OUT_DIR

benchmarks/results/h200-e2e-variants.json came from an earlier form of this script, run on commit
9a29206, where the single launch also took its previous output as an input (variant "single"); its
"single-no-chain" variant is the single launch as it is now.
"""

import json
import sys

import mlx.core as mx

from cartridge.attention.kernels import cuda
from cartridge.eval import bench


def main(out):
    model = bench.random_model("llama3.2-1b")
    bench.POLICIES = ["fused"]
    rows = []
    for rnd in range(2):
        for variant in ("single", "two-launch"):
            cuda.SINGLE_LAUNCH = variant == "single"
            for row in bench.end_to_end(model, 32768, ["mlx4g32"], mx.float16):
                if row["tokens_per_s"] is not None:
                    rows.append({**row, "variant": variant, "pass": rnd})
                    print(variant, rnd, row["tier"], round(row["tokens_per_s"], 1), flush=True)
            json.dump(rows, open(f"{out}/gpu_e2e_variants.json", "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".")
