"""Run cartridge's generated Metal kernels on the CPU (tests/helpers/metal_emu.h), in place of `mx.fast.metal_kernel`.

`EmulatedKernel(name, input_names, output_names, source, header)` is called like the object metal_kernel returns
(inputs=, grid=, threadgroup=, output_shapes=, output_dtypes=): the source is assembled as MLX assembles it
(metal_source.assemble), the body's `threadgroup` arrays become statics (threadgroups run one after another), and
it is built with g++ into a shared library with a launcher that runs one std::thread per GPU thread. Outputs
start as NaN, so an element a kernel never writes shows. This checks the kernels' logic: indexing, the tiers'
decodes, the softmax and merges. It cannot check Apple's compiler or GPU (see docs/performance.md).
"""

import ctypes
import functools
import hashlib
import re
import subprocess
from pathlib import Path

import mlx.core as mx
import numpy as np

from cartridge.attention.backends import cpu as cpu_backend, cuda as cuda_backend, metal as metal_backend
from cartridge.attention.kernels import metal
from helpers.metal_source import ATTRIBUTES, TYPE_STRINGS, assemble, compiler

EMU = Path(__file__).with_name("metal_emu.h")
BUILD = Path("/tmp") / "cartridge-metal-emu"
NP_VIEW = {mx.bfloat16: mx.uint16}  # numpy has no bfloat16: its bits
ATTR_VALUES = {"threadgroup_position_in_grid": "uint3{x, y, z}", "simdgroup_index_in_threadgroup": "tid / 32",
               "thread_index_in_simdgroup": "tid % 32", "thread_index_in_threadgroup": "tid",
               "thread_position_in_grid": "uint3{x * nt + tid, y, z}"}


def _dtype_name(dtype):
    return str(dtype).split(".")[-1]


def _launcher(name, arg_types, attrs):
    args = [f"({t})b[{i}]" for i, t in enumerate(arg_types)] + [ATTR_VALUES[a] for a in attrs]
    return f"""
extern "C" void emu_launch(void** b, unsigned gx, unsigned gy, unsigned gz, unsigned nt) {{
  for (unsigned z = 0; z < gz; ++z)
    for (unsigned y = 0; y < gy; ++y)
      for (unsigned x = 0; x < gx; ++x) {{
        EmuGroup g;
        std::barrier<> tgb(nt);
        std::vector<std::unique_ptr<std::barrier<>>> sb;
        g.tg_barrier = &tgb;
        for (unsigned s = 0; s < (nt + 31) / 32; ++s) {{
          sb.emplace_back(new std::barrier<>(32));
          g.simd_barrier[s] = sb.back().get();
        }}
        std::vector<emu_thread> ts;
        for (unsigned tid = 0; tid < nt; ++tid)
          ts.emplace_back([&, tid] {{
            emu_group = &g;
            emu_tid = tid;
            {name}({", ".join(args)});
          }});
        for (auto& t : ts) t.join();
      }}
}}
"""


class EmulatedKernel:
    """A CPU stand-in for the object `mx.fast.metal_kernel(name, input_names, output_names, source, header)`."""

    def __init__(self, name, input_names, output_names, source, header):
        self.name, self.input_names, self.output_names = name, input_names, output_names
        self.source, self.header = source, header
        self._libs = {}

    def _lib(self, in_dtypes, out_dtypes):
        key = (tuple(in_dtypes), tuple(out_dtypes))
        if key in self._libs:
            return self._libs[key]
        text = assemble(self.name, self.input_names, [(d, 8, 1) for d in in_dtypes], self.output_names, out_dtypes,
                        self.header, re.sub(r"(?m)^threadgroup ", "static ", self.source))
        attrs = [a for a in ATTRIBUTES if a in self.source]
        types = [f"const {TYPE_STRINGS[d]}*" for d in in_dtypes] + [f"{TYPE_STRINGS[d]}*" for d in out_dtypes]
        full = f'#include "{EMU}"\n' + text + _launcher(self.name, types, attrs)
        BUILD.mkdir(exist_ok=True)
        digest = hashlib.sha256(full.encode()).hexdigest()[:16]
        so = BUILD / f"{digest}.so"
        if not so.exists():
            src = BUILD / f"{digest}.cpp"
            src.write_text(full)
            done = subprocess.run([compiler(), "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", "-w", str(src),
                                   "-o", str(so) + ".tmp"], capture_output=True, text=True)
            if done.returncode:
                raise RuntimeError(done.stderr[:4000])
            Path(str(so) + ".tmp").rename(so)
        lib = ctypes.CDLL(str(so))
        lib.emu_launch.argtypes = [ctypes.POINTER(ctypes.c_void_p)] + [ctypes.c_uint] * 4
        self._libs[key] = lib
        return lib

    def __call__(self, inputs, grid, threadgroup, output_shapes, output_dtypes, init_value=None, **_):
        assert all(x.size >= 8 for x in inputs), "an input below 8 elements would be `constant` on Metal"
        assert threadgroup[1] == threadgroup[2] == 1 and all(g % t == 0 for g, t in zip(grid, threadgroup))
        host = [np.ascontiguousarray(np.array(x.view(NP_VIEW[x.dtype]) if x.dtype in NP_VIEW else x)) for x in inputs]
        outs = [np.full(shape, np.nan, dtype=np.float32).astype(np.float16 if d == mx.float16 else np.float32)
                if d != mx.bfloat16 else np.full(shape, 0x7FC0, dtype=np.uint16) for shape, d in
                zip(output_shapes, output_dtypes)]
        lib = self._lib([_dtype_name(x.dtype) for x in inputs], [_dtype_name(d) for d in output_dtypes])
        ptrs = (ctypes.c_void_p * (len(host) + len(outs)))(*[a.ctypes.data for a in host + outs])
        lib.emu_launch(ptrs, grid[0] // threadgroup[0], grid[1], grid[2], threadgroup[0])
        return [mx.array(o).view(mx.bfloat16) if d == mx.bfloat16 else mx.array(o)
                for o, d in zip(outs, output_dtypes)]


def emulate_metal_device(monkeypatch):
    """Make this process's attention registry see a Mac whose Metal kernels run on `EmulatedKernel`: the Metal
    entry is the current device (the CPU's and CUDA's are not), its kernel module is available, and each kernel it
    builds is emulated (built once per variant). Returns the list of kernel names called, in order, that each call
    appends."""
    calls = []

    class Counted(EmulatedKernel):
        def __call__(self, *args, **kwargs):
            calls.append(self.name)
            return super().__call__(*args, **kwargs)

    @functools.cache
    def kernel(kind, consts):
        name, inputs, outputs, body = metal.kernel_spec(kind, consts)
        return Counted(name, inputs, outputs, body, metal.header())

    monkeypatch.setattr(metal, "_kernel", kernel)
    monkeypatch.setattr(metal, "available", lambda: True)
    monkeypatch.setattr(metal_backend.METAL, "is_current", lambda: True)
    for other in (cpu_backend.CPU, cuda_backend.CUDA):
        monkeypatch.setattr(other, "is_current", lambda: False)
    return calls
