"""Load OpenBLAS ahead of MLX on Linux.

MLX's Linux CPU wheel links the reference BLAS: float32 matmul ran at 4 GFLOP/s, and at
237-435 GFLOP/s with OpenBLAS loaded first (DEVELOPERS.md, measured). Loading libopenblas with
RTLD_GLOBAL before libmlx makes the dynamic linker resolve MLX's cblas/lapack symbols to it.
Set CARTRIDGE_NO_OPENBLAS=1 to skip.
"""

import ctypes
import os
import sys

CANDIDATES = ("libopenblas.so.0", "libopenblas.so", "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
              "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0")


def preload_openblas():
    """Return the OpenBLAS library loaded (or None) if on Linux and MLX is not yet imported."""
    if not sys.platform.startswith("linux") or "mlx.core" in sys.modules or os.environ.get("CARTRIDGE_NO_OPENBLAS"):
        return None
    for name in CANDIDATES:
        try:
            return ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            continue
    return None


OPENBLAS = preload_openblas()
