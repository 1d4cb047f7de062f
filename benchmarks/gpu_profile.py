"""Where a fused mlx4g32 decode step spends its time on the GPU machine (32 q / 8 kv heads, head_dim 128,
fp16, one layer): the single-launch kernel rebuilt with %globaltimer stamps per block (start, end of pass
1, end of the finish in each KV head's last block), so a step splits into block start skew, the spread of
pass-1 ends across blocks, and the finish after a head's last pass-1 block. (Plain streaming reads of the
same bytes, which this script's "read" option timed before, are in gpu_floor.py: its unroll-1 rows run
that kernel.)
                                           python3 benchmarks/gpu_profile.py OUT_DIR
Results: results/h200-profile.json.
"""

import json
import sys

import mlx.core as mx
import numpy as np

from cartridge.attention.kernels import cuda
from cartridge.eval import bench

sys.path.insert(0, "benchmarks")
from gpu_check import decode_cache, session_start  # noqa: E402
from gpu_timing import random_kv  # noqa: E402

STAMP = 'asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t_now));\n'


def stamped_spec(consts):
    """kernel_spec of the single-launch mma kernel with an extra uint64 output `ts` (blocks x 4): start,
    pass-1 end, finish end (a KV head's last block; 0 elsewhere), SM id."""
    name, inputs, outputs, body = cuda.kernel_spec("mma+finish", 1, consts)
    start = ("const int blk = blockIdx.y * gridDim.x + blockIdx.x;\nunsigned long long t_now;\n" + STAMP +
             "if (threadIdx.x == 0) {\n  ts[4 * blk] = t_now;\n  unsigned s;\n"
             '  asm("mov.u32 %0, %%smid;" : "=r"(s));\n  ts[4 * blk + 3] = s;\n}\n')
    finish = "  cart::finish_rows<T, HD, NKV>(O, M, L, prm, out, blockIdx.y);\n"
    for old, new in (("cart::flash_pass1_mma<", start + "cart::flash_pass1_mma<"),
                     ("if (cart::last_block", "__syncthreads();\n" + STAMP +
                      "if (threadIdx.x == 0) ts[4 * blk + 1] = t_now;\nif (cart::last_block"),
                     (finish, "{\n" + finish + "  __syncthreads();\n  " + STAMP +
                      "  if (threadIdx.x == 0) ts[4 * blk + 2] = t_now;\n}\n")):
        assert body.count(old) == 1, old
        body = body.replace(old, new)
    return name + "_stamped", inputs, outputs + ["ts"], body


def stamps(result, q, N, out):
    n_kv, D = 8, q.shape[-1]
    scale = D ** -0.5
    cache = decode_cache("mlx4g32", *random_kv(n_kv, N, D), q)
    fa = cache.prefix.kernel
    mx.eval(cache.attention(q, scale))
    plan = next(iter(fa._plans.values()))
    us = bench.timeit(lambda x: cache.attention(x, scale), 10, chain=q) * 1e6
    name, inputs, outputs, body = stamped_spec(plan.consts)
    kern = mx.fast.cuda_kernel(name=name, input_names=inputs, output_names=outputs, source=body,
                               header=cuda._header()[0])
    n_splits = plan.grid[0] // plan.threads
    n_blocks = n_splits * plan.grid[1]
    work = cache.scratch[plan]
    prm = fa._params(plan, 1, cache.tail_len, cache.chunk_size)

    def call(x):
        return kern(inputs=[x, *plan.inputs, prm, work, cache._k_chunks[0], cache._v_chunks[0]], grid=plan.grid,
                    threadgroup=(plan.threads, 1, 1), output_shapes=[x.shape, (n_blocks * 4,)],
                    output_dtypes=[x.dtype, mx.uint64], init_value=0)

    # one after the other: the two kernels share the cache's work buffer (partials, block counters)
    ref = cache.attention(q, scale)
    mx.eval(ref)
    got = call(q)[0]
    mx.eval(got)
    same = bool(mx.array_equal(ref, got).item())
    us_stamped = bench.timeit(lambda x: call(x)[0], 10, chain=q) * 1e6
    for rep in range(3):
        x = q
        for _ in range(20):
            x, ts = call(x)
        t = np.array(ts).reshape(n_blocks, 4).astype(np.int64)
        t0 = t[:, 0].min()
        start, p1 = t[:, 0] - t0, t[:, 1] - t0
        last = t[:, 2] > 0
        ms = lambda v: round(float(v) / 1e3, 2)  # noqa: E731
        head = np.arange(n_blocks) // n_splits
        row = {"N": N, "rep": rep, "blocks": int(n_blocks), "step_us": round(us, 1),
               "step_stamped_us": round(us_stamped, 1), "stamped_equals_product": same,
               "kernel_span_us": ms(t[last, 2].max() - t0), "start_skew_us": ms(start.max()),
               "pass1_end_min_med_max_us": [ms(v) for v in (p1.min(), np.median(p1), p1.max())],
               "heads_last_pass1_end_us": [ms(p1[head == h].max()) for h in range(n_kv)],
               "finish_us": [ms(t[i, 2] - t[i, 1]) for i in np.flatnonzero(last)],
               "finishing_block_is_last_of_head": bool(all(t[i, 1] == t[head == head[i], 1].max()
                                                           for i in np.flatnonzero(last))),
               "distinct_sms": int(len(set(t[:, 3].tolist())))}
        result["stamps"].append(row)
        print(json.dumps(row), flush=True)
        if rep == 0:
            np.save(f"{out}/stamps_{N}.npy", t)
    del cache
    mx.clear_cache()


def main(out):
    result, q = session_start(stamps=[])
    for N in (32768, 131072):
        stamps(result, q, N, out)
        json.dump(result, open(f"{out}/gpu_profile.json", "w"), indent=1, default=str)


if __name__ == "__main__":
    main(sys.argv[1])
