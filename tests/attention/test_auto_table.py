"""`auto` from measurements (cartridge/attention/auto_table.py) and the bench gate: a bench result becomes a
table, lookups pick the nearest case, a user table replaces shipped cases, and slow tiers are flagged."""

import json

import cartridge  # noqa: F401, I001  (first: loads OpenBLAS before mlx)
import pytest
from click.testing import CliRunner

from cartridge.attention import auto_table as C
from cartridge.cli.main import cli
from cartridge.errors import InputError
from cartridge.eval.bench_report import gate


def _row(tier, policy, context, us, kind="cartridge", nbytes=1000):
    return {"kind": kind, "tier": tier, "policy": policy, "context": context, "us": us, "prefix_bytes": nbytes,
            "error": None}


def _result(backend="cpu", head_dim=64):
    rows = []
    for ctx, dense in ((2048, 100.0), (8192, 400.0)):
        rows.append(_row("dense float32", "mlx-sdpa", ctx, dense, kind="baseline"))
        rows.append(_row("mlx4g32", "read", ctx, 10.0 * ctx / 2048, kind="floor", nbytes=int(0.3125 * 2 * 2 * 3 * 64 * ctx)))
        rows.append(_row("mlx4g32", "portable", ctx, 300.0 * ctx / 2048))
        rows.append(_row("mlx4g32", "dequantize-once", ctx, 90.0 * ctx / 2048))
        rows.append(_row("bf16", "read", ctx, 5.0, kind="floor"))
        rows.append(_row("bf16", "portable", ctx, 80.0 * ctx / 2048))
        rows.append(_row("bf16", "dequantize-once", ctx, 95.0 * ctx / 2048))
        rows.append(_row("turbo4", "portable", ctx, None))
    return {"environment": {"backend": backend, "machine": "x86_64", "processor": "", "date": "2026-12-01",
                            "cores": 2},
            "shape": {"name": "smollm2-135m", "n_q_heads": 9, "n_kv_heads": 3, "head_dim": head_dim},
            "copy_bytes_per_s": 1e9, "attention": rows, "end_to_end": []}


def test_table_from_bench_has_one_entry_per_measured_case():
    t = C.table_from_bench(_result())
    assert t["version"] == 1
    got = {(e["tier"], e["context"]): (e["policy"], e["us"], e["dense_us"]) for e in t["entries"]}
    assert got == {
        ("bf16", 2048): ("portable", {"portable": 80.0, "dequantize-once": 95.0}, 100.0),
        ("bf16", 8192): ("portable", {"portable": 320.0, "dequantize-once": 380.0}, 400.0),
        ("mlx4g32", 2048): ("dequantize-once", {"portable": 300.0, "dequantize-once": 90.0}, 100.0),
        ("mlx4g32", 8192): ("dequantize-once", {"portable": 1200.0, "dequantize-once": 360.0}, 400.0),
    }  # turbo4 measured nothing: no entry
    e = t["entries"][0]
    assert (e["backend"], e["head_dim"], e["mode"], e["machine"], e["measured"]) == ("cpu", 64, "decode",
                                                                                      "x86_64 cpu (2 cores)", "2026-12-01")


def test_table_from_bench_refuses_other_json():
    with pytest.raises(InputError, match="not a `cartridge bench --json` result"):
        C.table_from_bench({"rows": []})


def test_choose_takes_the_nearest_case_and_says_why():
    entries = C.table_from_bench(_result())["entries"]
    policy, why = C.choose(entries, "cpu", ("mlx4g32", "mlx4g32"), 64, 7000, allowed={"portable", "dequantize-once"})
    assert policy == "dequantize-once"
    assert why == ("dequantize-once: 0.30x portable, 0.90x dense at 8192 tokens (mlx4g32, head_dim 64), "
                   "measured 2026-12-01 on x86_64 cpu (2 cores)")
    assert C.choose(entries, "cpu", ("bf16", "bf16"), 128, 100)[0] == "portable"  # nearest head_dim and context
    # a layer of two tiers: the policy with the least summed time (bf16 K: 80 vs 95, mlx4g32 V: 300 vs 90)
    assert C.choose(entries, "cpu", ("bf16", "mlx4g32"), 64, 2048)[0] == "dequantize-once"
    assert C.choose(entries, "cpu", ("bf16", "mlx4g32"), 64, 2048, allowed={"portable"})[0] == "portable"
    policy, why = C.choose(entries, "cuda", ("bf16", "bf16"), 64, 2048)
    assert (policy, why) == ("fused", "fused: no measurement of bf16 on cuda in the auto table; the default there")
    # a layer no fused kernel reads (kivi4 on CUDA): the default is dequantize-once, not fused
    policy, why = C.choose(entries, "cuda", ("kivi4", "kivi4"), 64, 2048, allowed=("portable", "dequantize-once"))
    assert (policy, why) == ("dequantize-once", "dequantize-once: no measurement of kivi4 on cuda in the auto table; the default there")


def test_user_table_replaces_the_shipped_cases_it_measures(tmp_path, monkeypatch):
    shipped = tmp_path / "shipped"
    shipped.mkdir()
    C.write_table(C.table_from_bench(_result()), shipped / "cpu.json")
    monkeypatch.setattr(C, "SHIPPED", shipped)
    mine = _result()
    for r in mine["attention"]:
        if r["tier"] == "mlx4g32" and r["policy"] == "portable":
            r["us"] = 1.0
    user = C.write_table(C.table_from_bench(mine), tmp_path / "cfg" / "auto-table.json")
    monkeypatch.setenv("CARTRIDGE_AUTO_TABLE", str(user))
    assert C.user_table_path() == user
    entries = C.merged_entries()
    assert len(entries) == 4
    assert C.choose(entries, "cpu", ("mlx4g32",), 64, 8192)[0] == "portable"
    assert C.choose(C.merged_entries(tmp_path / "absent.json"), "cpu", ("mlx4g32",), 64, 8192)[0] == "dequantize-once"
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(InputError, match="attention table"):
        C.merged_entries(tmp_path / "bad.json")


def test_shipped_tables_parse():
    for e in C.merged_entries(C.SHIPPED / "no-user-table.json"):
        assert set(e) >= {"backend", "tier", "head_dim", "mode", "context", "policy", "us"}
        assert e["policy"] in e["us"]


def test_gate_flags_a_tier_slower_than_dense():
    rows = gate(_result())
    got = {(r["tier"], r["context"]): (r["policy"], r["vs_dense"], r["vs_read"], r["slower_than_dense"]) for r in rows}
    assert got == {("mlx4g32", 2048): ("dequantize-once", 0.9, 9.0, False),
                   ("bf16", 2048): ("portable", 0.8, 16.0, False),
                   ("mlx4g32", 8192): ("dequantize-once", 0.9, 9.0, False),
                   ("bf16", 8192): ("portable", 0.8, 64.0, False)}
    res = _result()
    for r in res["attention"]:
        if r["tier"] == "bf16" and r["context"] == 8192:
            r["us"] = r["us"] and r["us"] * 2  # 640 / 760 us against dense 400
    flagged = [(r["tier"], r["context"]) for r in gate(res) if r["slower_than_dense"]]
    assert flagged == [("bf16", 8192)]
    assert next(r for r in gate(res) if r["tier"] == "mlx4g32")["bytes_vs_fp16"] == pytest.approx(0.3125)


def test_bench_from_json_prints_the_gate_and_calibrates(tmp_path):
    res = _result()
    for r in res["attention"]:
        if r["tier"] == "bf16" and r["context"] == 8192 and r["kind"] == "cartridge":
            r["us"] *= 2
    src = tmp_path / "bench.json"
    src.write_text(json.dumps(res))
    table = tmp_path / "t" / "table.json"
    out = CliRunner().invoke(cli, ["bench", "--from-json", str(src), "--calibrate", "--table", str(table)])
    assert out.exit_code == 0, out.output
    flagged = [line.split()[:2] for line in out.output.splitlines() if line.endswith("SLOWER THAN DENSE")]
    assert flagged == [["8192", "bf16"]]
    assert json.loads(table.read_text()) == C.table_from_bench(res)
    out = CliRunner().invoke(cli, ["bench", "--from-json", str(tmp_path / "none.json")])
    assert isinstance(out.exception, InputError) and "cannot read it" in str(out.exception)


def test_header_plan_on_cuda_offers_fused_only_where_a_kernel_reads_both_tiers(monkeypatch):
    """inspect's policy line (plan_from_header) knows the layer by its tier names: a tier with no fused kernel must
    not be planned as fused, or inspect would name a path load does not take."""
    from cartridge.attention import backends, policy
    from cartridge.tiers.affine import Int6Codec

    monkeypatch.setattr(backends, "device", lambda: "cuda")
    monkeypatch.setattr(backends.CUDA, "available", lambda: True)  # as on a CUDA device
    assert "fused" in policy._allowed_by_name(("mlx4g32+rot", "int8"))
    assert "fused" in policy._allowed_by_name(("kivi4", "int6+rot"))  # flash_pass1_tc reads both
    monkeypatch.setattr(Int6Codec, "kernel_layout", None)  # as if no kernel read int6
    assert policy._allowed_by_name(("int6", "int6+rot")) == ("portable", "dequantize-once")
    assert policy._allowed_by_name(("kivi4", "int6")) == ("portable", "dequantize-once")


def test_question_rows_never_replace_decode_rows_however_short_the_question():
    """A 2-token question (6 query rows) is a question prefill, not a decode step: the table's decode entry
    comes from the decode rows and the question's from its own longest question."""
    env = {"backend": "cpu", "date": "2026-12-02", "machine": "x86_64"}
    dec = [{"kind": "baseline", "tier": "dense float32", "policy": "mlx-sdpa", "context": 512, "us": 289.0},
           {"kind": "cartridge", "tier": "fp16", "policy": "portable", "context": 512, "us": 539.0},
           {"kind": "cartridge", "tier": "fp16", "policy": "dequantize-once", "context": 512, "us": 378.0}]
    multi = [{"kind": "baseline", "tier": "dense float32", "policy": "mlx-sdpa", "context": 512, "query_tokens": L,
              "query_rows": 3 * L, "us": 370.0 + L} for L in (1, 2)]
    multi += [{"kind": "cartridge", "tier": "fp16", "policy": p, "context": 512, "query_tokens": L,
               "query_rows": 3 * L, "us": us + L} for L in (1, 2) for p, us in (("portable", 596.0), ("dequantize-once", 900.0))]
    result = {"environment": env, "shape": {"head_dim": 64}, "attention": dec, "multi_token": multi}
    entries = {e["mode"]: e for e in C.table_from_bench(result)["entries"]}
    assert entries["decode"]["us"] == {"portable": 539.0, "dequantize-once": 378.0} and entries["decode"]["dense_us"] == 289.0
    assert entries["multi-token"]["us"] == {"portable": 598.0, "dequantize-once": 902.0}
    assert entries["multi-token"]["policy"] == "portable" and entries["multi-token"]["dense_us"] == 372.0
