"""The full source of a Metal kernel as `mx.fast.metal_kernel` assembles it (MLX 0.32: `write_signature` in
mlx/backend/metal/custom_kernel.cpp), and its compile with the system C++ compiler against tests/helpers/metal_shim.h.

MLX writes: its utils text (here the shim stands in for it), the header, then
`[[kernel]] void NAME(` + one line per input `const device|constant TYPE* NAME [[buffer(i)]],` (`constant` for an
array of fewer than 8 elements, `&` for a 0-d one; `NAME_shape` / `_strides` / `_ndim` lines where the body names
them) + one line per output `device TYPE* NAME [[buffer(i)]]` + each Metal attribute the body names
(`uint3 threadgroup_position_in_grid [[threadgroup_position_in_grid]]`, ...) + `) {` + body + `}`.
"""

import re
import shutil
import subprocess
from pathlib import Path

SHIM = Path(__file__).with_name("metal_shim.h")
# MLX's get_type_string
TYPE_STRINGS = {"float16": "float16_t", "bfloat16": "bfloat16_t", "float32": "float", "uint8": "uint8_t",
                "uint32": "uint32_t", "int32": "int32_t", "bool": "bool"}
# the attributes metal_kernel recognizes in a body, with their types (python/src/fast.cpp)
ATTRIBUTES = {"dispatch_quadgroups_per_threadgroup": "uint", "dispatch_simdgroups_per_threadgroup": "uint",
              "dispatch_threads_per_threadgroup": "uint3", "grid_origin": "uint3", "grid_size": "uint3",
              "quadgroup_index_in_threadgroup": "uint", "quadgroups_per_threadgroup": "uint",
              "simdgroup_index_in_threadgroup": "uint", "simdgroups_per_threadgroup": "uint",
              "thread_execution_width": "uint", "thread_index_in_quadgroup": "uint",
              "thread_index_in_simdgroup": "uint", "thread_index_in_threadgroup": "uint",
              "thread_position_in_grid": "uint3", "thread_position_in_threadgroup": "uint3",
              "threadgroup_position_in_grid": "uint3", "threadgroups_per_grid": "uint3",
              "threads_per_grid": "uint3", "threads_per_simdgroup": "uint", "threads_per_threadgroup": "uint3"}


def assemble(name, input_names, inputs, output_names, output_dtypes, header, body):
    """The kernel source MLX compiles. `inputs`: (dtype name, element count, ndim) per input."""
    lines, index = [], 0
    for arg, (dtype, size, ndim) in zip(input_names, inputs):
        space = "constant" if size < 8 else "device"
        lines.append(f"  const {space} {TYPE_STRINGS[dtype]}{'&' if ndim == 0 else '*'} {arg} [[buffer({index})]]")
        index += 1
        for suffix, decl in (("_shape", "const constant int*"), ("_strides", "const constant int64_t*"),
                             ("_ndim", "const constant int&")):
            if ndim > 0 and arg + suffix in body:
                lines.append(f"  {decl} {arg}{suffix} [[buffer({index})]]")
                index += 1
    for arg, dtype in zip(output_names, output_dtypes):
        lines.append(f"  device {TYPE_STRINGS[dtype]}* {arg} [[buffer({index})]]")
        index += 1
    lines += [f"  {kind} {attr} [[{attr}]]" for attr, kind in ATTRIBUTES.items() if attr in body]
    return f"{header}[[kernel]] void {name}(\n" + ",\n".join(lines) + ") {\n" + body + "\n}\n"


def compiler():
    """The system C++ compiler (g++, clang++ or c++), or None."""
    return next((shutil.which(c) for c in ("g++", "clang++", "c++") if shutil.which(c)), None)


def compile_sources(texts, workdir):
    """Compile each text (with the shim, standing in for MLX's utils, included first) by one compiler process;
    returns (returncode, diagnostics). Warnings about Metal's attributes ([[kernel]], [[buffer(i)]]) are off."""
    files = []
    for i, text in enumerate(texts):
        f = Path(workdir) / f"k{i}.cpp"
        f.write_text(f'#include "{SHIM}"\n' + text)
        files.append(str(f))
    cmd = [compiler(), "-std=c++17", "-fsyntax-only", "-Wno-attributes", "-Werror=return-type", *files]
    done = subprocess.run(cmd, capture_output=True, text=True)
    return done.returncode, re.sub(r"\n{3,}", "\n\n", done.stderr)
