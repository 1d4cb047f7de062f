"""`cartridge bench` and `cartridge eval` options and output files: every bad option or output path is
refused in one stderr line before any work; --json/--plot are never created in a missing folder, never
replace a file without --force, and are written atomically with the mode open() would give.

Runs the real entry point (`cartridge.cli.main.main`) in-process with the measuring parts replaced by fakes, so
nothing is prefilled or timed.
"""

import json
import os
import stat

import pytest

import cartridge
import cartridge.cli.eval as eval_cli
import cartridge.eval.bench as B
import cartridge.eval.evaluate
from cartridge.attention.backends import device
from cartridge.cli.main import main
from cartridge.format.atomic import TempDir, write_file

PNG = b"\x89PNG\r\n\x1a\n"


def _row(context, tier, policy, us):
    return {"kind": "cartridge", "tier": tier, "policy": policy, "context": context, "us": us,
            "prefix_bytes": 1000, "error": None}


FAKE_RESULT = {
    "environment": {"machine": "test", "backend": "cpu", "mlx": "0"},
    "shape": {"name": "smollm2-135m", "n_q_heads": 9, "n_kv_heads": 3, "head_dim": 64},
    "copy_bytes_per_s": 1e9,
    "attention": [_row(n, t, p, us) for n in (256, 512) for t, p, us in
                  (("dense float32", "mlx-sdpa", 10.0), ("fp16", "portable", 20.0))],
    "speedups": [], "end_to_end": [],
}


def cli(capsys, *args):
    """Run `cartridge ARGS` in-process: (exit status, stdout, stderr lines)."""
    try:
        main([str(a) for a in args])
        code = 0
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err.strip().splitlines()


def plain_mode(folder):
    """The permission bits a plain open() gives a new file in `folder`."""
    probe = folder / "probe"
    probe.write_text("")
    mode = stat.S_IMODE(probe.stat().st_mode)
    probe.unlink()
    return mode


@pytest.fixture
def bench_calls(monkeypatch):
    """Replace the measuring and the model loading by fakes; returns the list of B.run calls."""
    calls = []

    def fake_run(contexts, tiers, shape, e2e_model, e2e_contexts, repeats, progress=None, e2e_tiers=None,
                 query_tokens=()):
        calls.append({"contexts": contexts, "e2e_contexts": e2e_contexts, "repeats": repeats,
                      "policies": B.POLICIES})
        return FAKE_RESULT

    def no_model(*_, **__):
        raise AssertionError("bench loaded a model")

    monkeypatch.setattr(B, "run", fake_run)
    monkeypatch.setattr(B, "POLICIES", None)
    monkeypatch.setattr(B, "random_model", no_model)
    monkeypatch.setattr(cartridge, "load_model", no_model)
    return calls


KNOWN = ", ".join(["fused", "portable", "dequantize-once"] if device() == "cuda" else ["portable", "dequantize-once"])


@pytest.mark.parametrize("args, code, expect", [
    (["--contexts", "0"], 1, "--contexts 0: a context must be from 1 to 524288 tokens"),
    (["--contexts", "-5"], 1, "--contexts must be comma-separated token counts in plain digits"),
    (["--contexts", "5_12"], 1, "--contexts must be comma-separated token counts in plain digits (8192, not"),
    (["--contexts", "\u0665\u0661\u0662"], 1, "--contexts must be comma-separated token counts in plain"),
    (["--contexts", "512,,1024"], 1, "--contexts '512,,1024' has an empty item; separate token counts with"),
    (["--contexts", "100000000"], 1, "--contexts 100000000: a context must be"),
    (["--contexts", "524289"], 1, "--contexts 524289: a context must be"),
    (["--contexts", "256,x"], 1, "--contexts must be comma-separated token counts"),
    (["--contexts", ","], 1, "--contexts names no token count"),
    (["--e2e-contexts", "0"], 1, "--e2e-contexts 0: a context must be"),
    (["--e2e-contexts", "2000000"], 1, "--e2e-contexts 2000000: a context must be"),
    (["--repeats", "0"], 2, "'--repeats': 0 is not in the range 1<=x<=1000"),
    (["--repeats", "-3"], 2, "'--repeats': -3 is not in the range 1<=x<=1000"),
    (["--repeats", "99999999999999999999"], 2, "is not in the range 1<=x<=1000"),
    (["--policies", "portable,portable"], 1, "--policies names portable twice"),
    (["--policies", "auto"], 1, "bench measures policies one by one, not the auto choice; choose from"),
    (["--shape", ""], 1, "unknown shape ''; known:"),
    (["--policies", "portable,foo"], 1, f"unknown attention policy 'foo'; choose from: {KNOWN}"),
    (["--policies", ","], 1, "--policies names no policy"),
    (["--contexts", ""], 1, "--contexts names no token count"),
    (["--contexts", "256,512,256"], 1, "--contexts names 256 twice"),
    (["--tiers", ","], 1, "--tiers names no tier"),
    (["--tiers", ""], 1, "--tiers names no tier"),
    (["--tiers", "fp16,int8,fp16"], 1, "--tiers names fp16 twice"),
    (["--e2e-tiers", " "], 1, "--e2e-tiers names no tier"),
] + ([(["--policies", "fused"], 1, "attention policy 'fused' does not run on this backend (cpu); "
                                   f"choose from: {KNOWN}")] if device() == "cpu" else []))
def test_bench_bad_option_one_line_no_work(capsys, bench_calls, args, code, expect):
    status, out, err = cli(capsys, "bench", "--contexts", "256", *args)
    assert status == code
    assert len(err) == 1 and err[0].startswith("error: ") and expect in err[0], err
    assert out == "" and bench_calls == []


@pytest.mark.parametrize("option", ["--json", "--plot"])
def test_bench_bad_output_path_refused_before_work(capsys, bench_calls, tmp_path, option):
    (tmp_path / "old.json").write_text("old")
    (tmp_path / "dir").mkdir()
    cases = [(tmp_path / "no" / "r.out", f"folder {tmp_path / 'no'} does not exist"),
             (tmp_path / "old.json" / "r.out", f"{tmp_path / 'old.json'} is not a folder"),
             (tmp_path / "dir", "is a directory"),
             (tmp_path / "old.json", "exists; pass --force to replace it")]
    for path, expect in cases:
        status, out, err = cli(capsys, "bench", "--contexts", "256", option, path)
        assert status == 1
        assert len(err) == 1 and err[0].startswith(f"error: {option} ") and expect in err[0], err
    assert bench_calls == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir", "old.json"]  # nothing created
    assert list((tmp_path / "dir").iterdir()) == [] and (tmp_path / "old.json").read_text() == "old"


def test_bench_writes_outputs_atomically_with_plain_mode_and_force(capsys, bench_calls, tmp_path):
    j, p = tmp_path / "b.json", tmp_path / "b.png"
    status, out, err = cli(capsys, "bench", "--contexts", "256,512", "--e2e-contexts", "128", "--repeats", "1",
                           "--no-e2e", "--policies", "portable", "--json", j, "--plot", p)
    assert status == 0, err
    assert bench_calls == [{"contexts": [256, 512], "e2e_contexts": [128], "repeats": 1, "policies": ["portable"]}]
    assert json.loads(j.read_text()) == FAKE_RESULT and p.read_bytes()[:8] == PNG
    assert "copy bandwidth" in out
    mode = plain_mode(tmp_path)
    assert stat.S_IMODE(j.stat().st_mode) == mode and stat.S_IMODE(p.stat().st_mode) == mode
    assert sorted(x.name for x in tmp_path.iterdir()) == ["b.json", "b.png"]  # no temporaries left

    j.write_text("old")
    status, _, err = cli(capsys, "bench", "--contexts", "256", "--no-e2e", "--json", j)
    assert status == 1 and "exists; pass --force" in err[0] and j.read_text() == "old"
    status, _, err = cli(capsys, "bench", "--contexts", "256", "--no-e2e", "--json", j, "--plot", p, "--force")
    assert status == 0, err
    assert json.loads(j.read_text()) == FAKE_RESULT
    assert bench_calls[-1]["policies"] is None  # an earlier --policies does not stick
    assert sorted(x.name for x in tmp_path.iterdir()) == ["b.json", "b.png"]


def test_bench_help_states_limits(capsys):
    status, out, _ = cli(capsys, "bench", "--help")
    assert status == 0
    flat = " ".join(out.split())
    assert "1 to 524288" in flat and "1<=x<=1000" in flat and "--force" in flat


@pytest.fixture
def eval_files(tmp_path, monkeypatch):
    """A corpus, a questions file, and fakes for evaluate/table/plot (no model, no prefill)."""
    (tmp_path / "doc.txt").write_text("The rent is 900 euros.\n")
    (tmp_path / "q.jsonl").write_text('{"id": 1, "question": "What is the rent?"}\n')
    calls = []

    def fake_evaluate(text, questions, **_):
        calls.append(text)
        return {"rows": [], "model": {"ref": "fake"}}

    def fake_plot(report, path):
        with open(path, "wb") as f:
            f.write(PNG)

    monkeypatch.setattr(cartridge.eval.evaluate, "evaluate", fake_evaluate)
    monkeypatch.setattr(eval_cli, "text_table", lambda report: "table")
    monkeypatch.setattr(eval_cli, "write_plot", fake_plot)
    return tmp_path, calls


def _eval(capsys, folder, *extra):
    return cli(capsys, "eval", folder / "doc.txt", "--questions", folder / "q.jsonl", "--tiers", "fp16",
               "--needles", "none", *extra)


def test_eval_refuses_existing_outputs_without_force(capsys, eval_files):
    folder, calls = eval_files
    (folder / "r.json").write_text("old")
    (folder / "r.png").write_text("old")
    for option, name in (("--json", "r.json"), ("--plot", "r.png")):
        status, _, err = _eval(capsys, folder, option, folder / name)
        assert status == 1
        assert err == [f"error: {option} {folder / name} exists; pass --force to replace it"]
    assert calls == []
    assert (folder / "r.json").read_text() == "old" and (folder / "r.png").read_text() == "old"

    status, out, err = _eval(capsys, folder, "--json", folder / "r.json", "--plot", folder / "r.png", "--force")
    assert status == 0, err
    assert out.strip() == "table" and len(calls) == 1
    assert json.loads((folder / "r.json").read_text())["corpus"] == str(folder / "doc.txt")
    assert (folder / "r.png").read_bytes() == PNG


def test_eval_outputs_have_plain_mode(capsys, eval_files):
    folder, _ = eval_files
    status, _, err = _eval(capsys, folder, "--json", folder / "e.json", "--plot", folder / "e.png")
    assert status == 0, err
    mode = plain_mode(folder)
    for name in ("e.json", "e.png"):
        assert stat.S_IMODE((folder / name).stat().st_mode) == mode, name
    assert sorted(p.name for p in folder.iterdir()) == ["doc.txt", "e.json", "e.png", "q.jsonl"]


def test_write_file_mode_failure_and_refusals(tmp_path):
    dest = tmp_path / "out.txt"
    assert write_file(dest, lambda tmp: tmp.write_text("one")) == dest
    assert dest.read_text() == "one" and stat.S_IMODE(dest.stat().st_mode) == plain_mode(tmp_path)
    write_file(dest, lambda tmp: tmp.write_text("two"))  # replaces a file
    assert dest.read_text() == "two"

    def fail(tmp):
        tmp.write_text("partial")
        raise RuntimeError("disk on fire")

    with pytest.raises(RuntimeError):
        write_file(dest, fail)
    assert dest.read_text() == "two"
    with pytest.raises(FileNotFoundError):
        write_file(tmp_path / "no" / "x.txt", lambda tmp: tmp.write_text("x"))
    (tmp_path / "d").mkdir()
    with pytest.raises(IsADirectoryError):
        write_file(tmp_path / "d", lambda tmp: tmp.write_text("x"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d", "out.txt"]  # no temporaries, no new folder


def test_tempdir_directory_keeps_plain_directory_mode(tmp_path):
    t = TempDir(tmp_path / "cart")
    (t.path / "f").write_text("x")
    t.publish(force=False)
    os.mkdir(tmp_path / "plain")
    assert stat.S_IMODE((tmp_path / "cart").stat().st_mode) == stat.S_IMODE((tmp_path / "plain").stat().st_mode)


def test_bench_refuses_one_file_for_json_and_plot_and_a_plot_not_png(capsys, bench_calls, tmp_path):
    same = tmp_path / "r.png"
    status, out, err = cli(capsys, "bench", "--contexts", "256", "--no-e2e", "--json", same, "--plot",
                           tmp_path / "." / "r.png")
    assert status == 1 and len(err) == 1 and "--json and --plot name the same file" in err[0], err
    status, out, err = cli(capsys, "bench", "--contexts", "256", "--no-e2e", "--plot", tmp_path / "r.svg")
    assert status == 1 and len(err) == 1 and "the plot is a PNG; give a file name ending in .png" in err[0], err
    assert bench_calls == [] and list(tmp_path.iterdir()) == []


def test_bench_refuses_end_to_end_contexts_that_cannot_fit(monkeypatch):
    """The dense baseline cache of the end-to-end part is estimated before any work (an out-of-memory
    kill would lose every result of the run)."""
    import mlx.core as mx

    from cartridge.cli.bench import _check_memory
    from cartridge.errors import InputError

    monkeypatch.setattr(B, "model_geometry", lambda model: (10**6, 64, 128))  # absurdly large: never fits
    with pytest.raises(InputError, match=r"end-to-end decode at 1,024 tokens needs about .* GiB for the dense"):
        _check_memory(B, None, mx.float32, [1024])
    monkeypatch.setattr(B, "model_geometry", lambda model: (1, 1, 64))
    _check_memory(B, None, mx.float32, [1024])  # 1 MiB: fits anywhere
    # on CUDA the GPU's memory counts ("total_memory"), not the host's: 1 MiB does not fit in 1 MiB
    monkeypatch.setattr(mx, "device_info", lambda: {"total_memory": 2**20})
    with pytest.raises(InputError, match=r"needs about 0.0 GiB .* this device has 0.0 GiB"):
        _check_memory(B, None, mx.float32, [1024])


def test_chained_gpu_timing_is_the_cost_of_one_more_step(monkeypatch):
    """On a GPU a chained step's time is the difference between a long and a short chain per step: a fixed
    cost per evaluation (graph launch, the first graph's host encoding) cancels. A fake clock advances 40 us
    per evaluation plus 3 us per chained step; the CPU method (one step per round) pays both."""
    clock = [0.0]

    class Step:
        def __init__(self, n):
            self.n = n

    def fake_eval(outs):
        clock[0] += 40e-6 + 3e-6 * sum(o.n for o in outs)

    monkeypatch.setattr(B.mx, "eval", fake_eval)
    monkeypatch.setattr(B.time, "perf_counter", lambda: clock[0])
    from cartridge.attention import timing  # the clock of bench and the proofs; it asks backends.device()

    monkeypatch.setattr(timing, "device", lambda: "cuda")
    assert B.timeit(lambda x: Step(x.n + 1), 5, chain=Step(0)) == pytest.approx(3e-6)
    monkeypatch.setattr(timing, "device", lambda: "cpu")
    assert B.timeit(lambda x: Step(x.n + 1), 5, chain=Step(0)) == pytest.approx(43e-6)


def test_bench_unwritable_folder_names_the_option(capsys, bench_calls):
    status, out, err = cli(capsys, "bench", "--contexts", "256", "--plot", "/proc/x.png")
    assert status == 1 and bench_calls == []
    assert len(err) == 1 and err[0].startswith("error: --plot /proc/x.png: folder /proc is not writable"), err


def test_missing_cartridge_is_named_as_missing(capsys, tmp_path):
    for command in ("inspect", "verify"):
        status, out, err = cli(capsys, command, str(tmp_path / "nope.cart"))
        assert status == 1 and err == [f"error: {tmp_path / 'nope.cart'} does not exist"], err
