"""Does `mx.asarray` of a numpy view of a mapped file (what load.py does with pages.bin) copy, and at what cost?

MLX 0.32 python/src/convert.cpp (nd_array_to_mlx_contiguous): "Make a copy of the numpy buffer": the
array(const T*, shape, dtype) constructor copies into a buffer of MLX's allocator (on Metal a shared-storage
MTLBuffer). Prints and writes (argv[1]) the time of 5 conversions of 256 MiB and the resident-set growth.
"""
import cartridge  # noqa: F401  (before mlx.core)
import json
import mmap
import os
import sys
import time

import mlx.core as mx
import numpy as np

path = os.environ.get("PAGES", "/tmp/map_copy_cost.bin")  # a scratch file of random page bytes
n = 256 * 1024 * 1024  # 256 MiB of page bytes
if not os.path.exists(path) or os.path.getsize(path) != n:
    with open(path, "wb") as f:
        f.write(np.random.default_rng(0).integers(0, 255, n, dtype=np.uint8).tobytes())
f = open(path, "rb")
m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
view = np.frombuffer(m, dtype=np.uint32).reshape(1024, 8, 32, -1)
_ = int(view[::7].sum())  # fault the file's pages in (page cache)
rss = lambda: int(open("/proc/self/statm").read().split()[1]) * 4096
times, extra = [], []
for _ in range(5):
    before = rss()
    t = time.perf_counter()
    a = mx.asarray(view)
    mx.eval(a)
    times.append(time.perf_counter() - t)
    extra.append(rss() - before)
    # shares memory? compare the buffer address of the MLX array with the mapping
    addr_np = view.__array_interface__["data"][0]
    addr_mx = np.array(a, copy=False).__array_interface__["data"][0]
    del a
res = {"bytes": n, "asarray_s": times, "median_s": sorted(times)[2], "GB_per_s": n / sorted(times)[2] / 1e9,
       "rss_growth_bytes": extra, "same_address": addr_np == addr_mx, "mlx": mx.__version__,
       "device": str(mx.default_device()), "machine": os.uname().machine, "cpus": os.cpu_count()}
print(json.dumps(res, indent=1))
if len(sys.argv) > 1:
    json.dump(res, open(sys.argv[1], "w"), indent=1)
