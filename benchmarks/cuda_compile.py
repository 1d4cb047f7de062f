"""Compile every fused kernel variant with nvcc on a machine without a GPU, as MLX's `cuda_kernel` would build it.

`mx.fast.cuda_kernel` compiles a kernel with NVRTC the first time it runs, so a CUDA error in flash_decode.cuh
would otherwise first show on the GPU machine. This script builds the same bodies (`cuda_source.kernel_spec`) inside
a `__global__` wrapper shaped like MLX's (one pointer per input and output), compiles them for sm_90a, and
prints per kernel the registers, spills and the size of its main loop in SASS instructions (cuobjdump; the
loop with the most tensor-core instructions): a cheap, repeatable proxy for the work per 16-token tile.

    python benchmarks/cuda_compile.py [--arch sm_90a] [--keep DIR] [--only LABEL_TEXT]

Needs nvcc (CUDA 12.4+); cuobjdump is optional (without it no loop sizes).
"""

import argparse
import collections
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import mlx.core as mx  # noqa: E402

from cartridge.attention.kernels import cuda, cuda_decode, cuda_prefill, cuda_source  # noqa: E402
from cartridge.attention.kernels.cuda_tuning import TUNING  # noqa: E402

FLOAT_INPUTS = {"sgk", "sgv", "cbk", "cbv", "cb", "snk", "work", "O", "M", "L"}
TIERS = {"fp16": (cuda.FP16, 0), "bf16": (cuda.BF16, 0), "int8": (cuda.AFF8, 0), "int6": (cuda.AFF6, 0),
         "mlx4g32": (cuda.AFF4, 0), "kivi4": (cuda.KIVI4, 0), "fp8": (cuda.MXFP8, 0), "mxfp4": (cuda.MXFP4, 0),
         "nvfp4": (cuda.NVFP4, 0), "turbo4": (cuda.TURBO, 4), "turbo3": (cuda.TURBO, 3), "turbo2": (cuda.TURBO, 2)}
LOOKUP = ("mxfp4", "nvfp4", "turbo4", "turbo3", "turbo2")


def variants():
    """(label, kind, consts) of the kernels to build: tensor-core pass 1 per tier and head_dim (both lookups
    for the lookup tiers, rotated K for the affine and FP4 tiers), the mlx4g32 pass 1 with and without
    rotation, the plain pass 1 of the tiers it reads, single launches and a finish."""
    for D in (64, 128):
        for name, (tid, bits) in TIERS.items():
            for rk, lreg in ((False, False), (False, True), (True, False)):
                if (lreg and name not in LOOKUP) or (rk and tid not in (cuda.AFF8, cuda.AFF6, cuda.AFF4, cuda.MXFP4,
                                                                        cuda.NVFP4)):
                    continue
                consts = (("T", mx.float16), ("TK", tid), ("BK", bits), ("TV", tid), ("BV", bits), ("HD", D),
                          ("NKV", 8), ("PAGE", 256), ("WARPS", TUNING.tc_warps), ("STAGES", TUNING.tc_stages),
                          ("RK", rk), ("LREG", lreg), ("SCALE", D ** -0.5))
                yield f"tc {name} d{D}{' rot' if rk else ''}{' regs' if lreg else ''}", "tc", consts
                if rk and not lreg:  # a +rot tier's single launch: the finish rotates V's prefix output back
                    yield f"tc+finish {name} d{D} rot", "tc+finish", consts + (("CH", 256), ("VROT", True))
        for rk in (False, True):
            consts = (("T", mx.float16), ("HD", D), ("NKV", 8), ("PAGE", 256), ("WARPS", TUNING.mma_warps),
                      ("STAGES", TUNING.mma_stages), ("RK", rk), ("SCALE", D ** -0.5))
            yield f"mma mlx4g32 d{D}{' rot' if rk else ''}", "mma", consts
            yield f"mma+finish mlx4g32 d{D}{' rot' if rk else ''}", "mma+finish", consts + (("CH", 256), ("VROT", rk))
        for name, tid, bits in (("fp16", cuda.FP16, 0), ("float32 pages", cuda.F32, 0), ("int8", cuda.AFF8, 0),
                                ("mlx4g32", cuda.AFF4, 0), ("fp8", cuda.MXFP8, 0), ("turbo4", cuda.TURBO, 4)):
            consts = (("T", mx.float16), ("TK", tid), ("TV", tid), ("BK", bits), ("BV", bits), ("HD", D), ("EPL", 8),
                      ("ROWS", 4), ("NKV", 8), ("PAGE", 256), ("WARPS", TUNING.warps), ("UNR", TUNING.unroll),
                      ("SCALE", D ** -0.5))
            yield f"pass1 {name} d{D}", "pass1", consts
            yield f"pass1+finish {name} d{D}", "pass1+finish", consts + (("CH", 256), ("VROT", False))
        finish = (("T", mx.float16), ("HD", D), ("NKV", 8), ("NCH", 2), ("CH", 256), ("VROT", True), ("SINKS", True),
                  ("NP", 32), ("SCALE", D ** -0.5))
        yield f"finish d{D}", "finish", finish
        for name, (tid, bits) in TIERS.items():
            for T in (mx.float16, mx.bfloat16) if name == "int8" else (mx.float16,):
                consts = (("T", T), ("TK", tid), ("BK", bits), ("TV", tid), ("BV", bits), ("HD", D), ("NKV", 8),
                          ("PAGE", 256), ("WARPS", TUNING.prefill_warps), ("SCALE", D ** -0.5))
                yield f"prefill {name} d{D}{' bf16' if T == mx.bfloat16 else ''}", "prefill", consts
            if tid in cuda_decode.DECODED_TIERS:
                consts = (("T", mx.float16), ("TIER", tid), ("BITS", bits), ("HD", D), ("NKV", 8), ("PAGE", 256),
                          ("WARPS", TUNING.decode_warps))
                yield f"decode {name} d{D}", "decode", consts


def wrapper(kind, consts):
    """The kernel as MLX builds it: `extern "C" __global__ void name(pointers...) { body }`, and its name."""
    n_chunks = dict(consts).get("NCH", 0) if kind == "finish" else 0
    if kind == "decode":
        name, inputs, outputs, body = cuda_decode.kernel_spec(consts, cuda_source.source_header()[1])
    elif kind == "prefill":
        name, inputs, outputs, body = cuda_prefill.kernel_spec(consts, cuda_source.source_header()[1])
    else:
        name, inputs, outputs, body = cuda_source.kernel_spec(kind, n_chunks, consts)
    T = cuda_source.CUDA_TYPES[dict(consts)["T"]]
    args = []
    for n in inputs:
        ctype = "float" if n in FLOAT_INPUTS else "int32_t" if n == "prm" else T if n in ("q", "pk", "pv") or \
            n[:2] in ("tk", "tv") else "uint32_t"
        args.append(f"const {ctype}* {n}")
    args += [f"{'float' if n in FLOAT_INPUTS else T}* {n}" for n in outputs]
    return name, f'extern "C" __global__ void {name}({", ".join(args)}) {{\n{body}}}\n'


def loop_sizes(sass):
    """{kernel name: (instructions, Counter of opcodes)} of the main loop (most HMMA/IMMA, then the shortest)."""
    out = {}
    for block in re.split(r"\n\s*Function : ", sass)[1:]:
        name = block.split("\n", 1)[0].strip()
        ins = [(int(m.group(1), 16), m.group(2).strip()) for m in
               re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", block)]
        best = None
        for addr, text in ins:
            m = re.search(r"BRA.*?0x([0-9a-f]+)", text)
            if not m or int(m.group(1), 16) >= addr:
                continue
            body = [t for a, t in ins if int(m.group(1), 16) <= a <= addr]
            ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for t in body)
            key = (ops["HMMA"] + ops["IMMA"], -len(body))
            if key[0] and (best is None or key > best[0]):
                best = (key, len(body), ops)
        if best:
            out[name] = best[1:]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--keep", type=Path, help="keep the .cu, the ptxas report and the SASS in this folder")
    ap.add_argument("--only", default="", help="build only the variants whose label contains this text")
    args = ap.parse_args()
    if shutil.which("nvcc") is None:
        sys.exit("cuda_compile: nvcc not found")
    work = Path(args.keep or tempfile.mkdtemp())
    work.mkdir(parents=True, exist_ok=True)
    labels, parts = {}, ["#include <cuda_fp16.h>", "#include <cuda_bf16.h>", "#include <cstdint>",
                         "#define inf (__int_as_float(0x7f800000))"]
    for label, kind, consts in variants():
        if args.only not in label:
            continue
        name, text = wrapper(kind, consts)
        labels[name] = label
        parts.append(cuda_source.source_header()[0] + text)
    (work / "kernels.cu").write_text("\n".join(parts))
    run = subprocess.run(["nvcc", f"-arch={args.arch}", "-cubin", "-Xptxas", "-v", "-o", str(work / "k.cubin"),
                          str(work / "kernels.cu")], capture_output=True, text=True)
    (work / "ptxas.log").write_text(run.stderr)
    if run.returncode:
        sys.exit(run.stderr[-4000:])
    regs = dict(re.findall(r"Compiling entry function '(\w+)'.*?Used (\d+) registers", run.stderr, re.S))
    spills = {n for n, s in re.findall(r"Compiling entry function '(\w+)'.*?(\d+) bytes spill stores", run.stderr, re.S)
              if int(s)}
    loops = {}
    if shutil.which("cuobjdump"):
        sass = subprocess.run(["cuobjdump", "-sass", str(work / "k.cubin")], capture_output=True, text=True).stdout
        (work / "k.sass").write_text(sass)
        loops = loop_sizes(sass)
    print(f"{len(labels)} kernels compiled for {args.arch}")
    print(f"{'kernel':34s} {'regs':>4s} {'loop':>5s} {'HMMA':>4s} {'LDS':>4s} {'LOP3':>4s} {'PRMT':>4s} {'IMAD':>4s}")
    for name, label in labels.items():
        n, ops = loops.get(name, (0, collections.Counter()))
        print(f"{label:34s} {regs.get(name, '?'):>4s} {n:5d} {ops['HMMA'] + ops['IMMA']:4d} {ops['LDS']:4d} "
              f"{ops['LOP3']:4d} {ops['PRMT']:4d} {ops['IMAD']:4d}{'  SPILLS' if name in spills else ''}")


if __name__ == "__main__":
    main()
