"""What `cartridge bench` reports from its measurements: the environment stated with every result, each
cartridge row against the baselines of its context (`speedups`), the fastest policy per tier against dense attention
and the bare read of its bytes (`gate`), and the plot."""

import os
import platform
import time

import mlx.core as mx

from ..attention import backends

def environment():
    """Machine, backend and versions, stated with every result."""
    info = {"machine": platform.machine(), "platform": platform.platform(), "backend": backends.device(),
            "mlx": mx.__version__, "date": time.strftime("%Y-%m-%d"), "cores": os.cpu_count()}
    if backends.device() == "cuda":
        try:
            info["device"] = mx.device_info().get("device_name")
        except Exception:  # device_info is absent on some MLX builds
            info["device"] = "cuda"
    else:
        info["processor"] = platform.processor()
    return info


def speedups(rows):
    """Per context: each cartridge row's time relative to MLX's dense attention row ("vs_dense": fp16 on
    a GPU, float32 on CPU; below 1 is faster), its speedup over mlx-lm's quantized path, and the prefix
    bytes it holds per second of attention."""
    out = []
    for ctx in sorted({r["context"] for r in rows}):
        at = [r for r in rows if r["context"] == ctx]
        base = {r["policy"]: r["us"] for r in at if r["kind"] == "baseline"}
        for r in at:
            if r["kind"] == "cartridge" and r["us"]:
                out.append({"context": ctx, "tier": r["tier"], "policy": r["policy"], "us": r["us"],
                            "vs_dense": r["us"] / base["mlx-sdpa"] if base.get("mlx-sdpa") else None,
                            "speedup_vs_mlx_lm_quantized": (base["mlx-lm-quantized"] / r["us"]
                                                            if base.get("mlx-lm-quantized") else None),
                            "effective_bytes_per_s": r["prefix_bytes"] / (r["us"] * 1e-6)})
    return out


def gate(result):
    """Per context and tier, the fastest policy of the run (the one `auto` would take from it) against the
    dense baseline and the bare read of the tier's bytes.

    Returns:
        list[dict]: {"context", "tier", "policy", "us", "vs_dense" (time over MLX's dense attention),
        "bytes_vs_fp16" (stored bytes over dense fp16 K/V), "vs_read" (time over `read_floor`),
        "slower_than_dense" (bool)}; ratios None where a baseline is missing.
    """
    shape, out = result["shape"], []
    fp16 = 2 * 2 * shape["n_kv_heads"] * shape["head_dim"]  # K + V bytes per token in fp16
    for ctx in sorted({r["context"] for r in result["attention"]}):
        at = [r for r in result["attention"] if r["context"] == ctx]
        dense = next((r["us"] for r in at if r["policy"] == "mlx-sdpa" and r["us"]), None)
        reads = {r["tier"]: r for r in at if r["kind"] == "floor"}
        best = {}
        for r in at:
            if r["kind"] == "cartridge" and r["us"] and (r["tier"] not in best or r["us"] < best[r["tier"]]["us"]):
                best[r["tier"]] = r
        for tier, r in best.items():
            read = reads.get(tier)
            out.append({"context": ctx, "tier": tier, "policy": r["policy"], "us": r["us"],
                        "vs_dense": r["us"] / dense if dense else None,
                        "bytes_vs_fp16": read["prefix_bytes"] / (fp16 * ctx) if read else None,
                        "vs_read": r["us"] / read["us"] if read and read["us"] else None,
                        "slower_than_dense": bool(dense and r["us"] > dense)})
    return out


def plot(result, path):
    """Attention microseconds vs context: one colour per tier, one line style per policy; PNG at `path`."""
    import matplotlib  # (matplotlib.use must come before pyplot's import; only for --plot)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # (after matplotlib.use)

    styles = {"fused": "-", "portable": "--", "dequantize-once": ":", "mlx-sdpa": "-", "mlx-lm-quantized": "-."}
    lines = {}
    for r in result["attention"]:
        if r["us"] and r["kind"] != "floor":
            lines.setdefault((r["tier"], r["policy"]), []).append((r["context"], r["us"]))
    tiers = sorted({t for t, _ in lines})
    colors = {t: plt.get_cmap("tab20")(i % 20) for i, t in enumerate(tiers)}
    fig, ax = plt.subplots(figsize=(9, 6))
    for (tier, policy), pts in sorted(lines.items()):
        pts.sort()
        baseline = policy in ("mlx-sdpa", "mlx-lm-quantized")
        ax.plot([p[0] for p in pts], [p[1] for p in pts], styles.get(policy, "-"), marker="o",
                color="black" if baseline else colors[tier], linewidth=2.5 if baseline else 1.2,
                label=f"{tier} · {policy}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("prefix tokens")
    ax.set_ylabel("decode-step attention, one layer (µs)")
    env, shape = result["environment"], result["shape"]
    ax.set_title(f"{env.get('device') or env['machine']} ({env['backend']}), MLX {env['mlx']}: {shape['name']} "
                 f"({shape['n_q_heads']} q / {shape['n_kv_heads']} kv heads, head_dim {shape['head_dim']})", fontsize=9)
    ax.legend(fontsize=6, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
