"""End-to-end decode on the GPU machine, variants of the fused path interleaved with the dense baseline
(Llama-3.2-1B shape, random fp16 weights, mlx4g32 cartridge, 32K prefix, best of 3 rounds of 32 tokens,
2 passes).   python3 benchmarks/gpu_e2e_variants.py OUT_DIR"""

import json
import sys

import mlx.core as mx

from cartridge import bench
from cartridge import cache as cache_module
from cartridge.kernels import cuda


class _KeepFirstPrev(dict):
    def __setitem__(self, key, value):
        if key == "prev" and key in self:
            return
        super().__setitem__(key, value)


class _NoChainScratch(dict):
    """Scratch whose single-launch state never takes the previous output: no edge between calls."""

    def __setitem__(self, key, value):
        super().__setitem__(key, _KeepFirstPrev(value))


def main(out):
    model = bench.random_model("llama3.2-1b")
    bench.POLICIES = ["fused"]
    init = cache_module.CartridgeCache.__init__
    rows = []
    for rnd in range(2):
        for variant in ("single", "single-no-chain", "two-launch"):
            cuda.SINGLE_LAUNCH = variant != "two-launch"

            def patched(self, *a, **k):
                init(self, *a, **k)
                if variant == "single-no-chain":
                    self.scratch = _NoChainScratch()

            cache_module.CartridgeCache.__init__ = patched
            for row in bench.end_to_end(model, 32768, ["mlx4g32"], mx.float16):
                if row["tokens_per_s"] is not None:
                    rows.append({**row, "variant": variant, "pass": rnd})
                    print(variant, rnd, row["tier"], round(row["tokens_per_s"], 1), flush=True)
            json.dump(rows, open(f"{out}/gpu_e2e_variants.json", "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".")
