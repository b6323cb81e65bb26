"""The collective benchmark: size parsing, busbw factors, the result checker, and a real small sweep.

The end-to-end test runs the CLI at world size 2 on two tiny sizes and checks the JSON against the
nccl-tests formulas; the checker tests prove a wrong result would be counted, not just that right
ones pass.
"""

from __future__ import annotations

import csv
import json

import pytest
import torch
import torch.distributed as dist

from shardlab.bench.cases import SENTINEL, Case, count_wrong, pattern
from shardlab.bench.sizes import OPS, format_size, parse_dtype, parse_size, parse_sizes
from shardlab.bench.sweep import CommBenchConfig, Point, busbw_factor, element_count, plan_points, registered_impls
from shardlab.bench.report import ROW_FIELDS, format_table
from shardlab.cli.main import main

REQUIRED = ["op", "impl", "world_size", "dtype", "bytes", "count", "time_us", "time_us_min", "time_us_max",
            "iters", "algbw_gbps", "busbw_gbps", "wrong", "frac_of_p2p", "frac_of_memcpy"]


# ---------------------------------------------------------------------------------- pure helpers
def test_parse_size_units_are_binary():
    assert parse_size("512") == 512
    assert parse_size("1K") == 1024
    assert parse_size("64k") == 64 * 1024
    assert parse_size("16M") == 16 * 2**20
    assert parse_size("1G") == 2**30
    assert parse_size("2MiB") == 2 * 2**20
    for bad in ("", "1X", "K", "-1K", "0.5"):
        with pytest.raises(ValueError):
            parse_size(bad)


def test_parse_sizes_lists_and_ranges():
    assert parse_sizes("1K,64K,16M") == [1024, 65536, 16 * 2**20]
    assert parse_sizes("1K-8K") == [1024, 2048, 4096, 8192]
    assert len(parse_sizes("1K-256M")) == 19  # 2^10 .. 2^28
    assert parse_sizes("4K,1K-2K,4K") == [1024, 2048, 4096]  # sorted, no duplicates
    with pytest.raises(ValueError):
        parse_sizes("8K-1K")
    assert format_size(65536) == "64 KiB" and format_size(3 * 2**19) == "1.50 MiB" and format_size(100) == "100 B"


def test_parse_dtype_aliases():
    assert parse_dtype("bf16") == "bfloat16" and parse_dtype("fp32") == "float32"
    with pytest.raises(ValueError):
        parse_dtype("complex64")


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_busbw_factors_are_nccl_tests(n):
    assert busbw_factor("all_reduce", n) == 2 * (n - 1) / n
    for op in ("all_gather", "reduce_scatter", "all_to_all"):
        assert busbw_factor(op, n) == (n - 1) / n
    for op in ("broadcast", "reduce", "sendrecv"):
        assert busbw_factor(op, n) == 1.0
    with pytest.raises(ValueError):
        busbw_factor("gather", n)


def test_element_count_whole_buffer():
    # all_gather's size is the whole output: 1 KiB of float32 at n = 3 is 255 elements (85 per rank).
    assert element_count("all_gather", 1024, 3, 4) == 255
    assert element_count("all_reduce", 1024, 3, 4) == 256
    assert element_count("all_to_all", 1024, 4, 2) == 512
    assert element_count("reduce_scatter", 4, 4, 4) == 0


def test_pattern_sums_are_exact_in_low_precision():
    n = 8
    everyone = list(range(n))
    for dtype in (torch.bfloat16, torch.float16, torch.int8):
        total = pattern(everyone, 17, 1000, dtype)
        exact = sum(pattern(r, 17, 1000, torch.int64) for r in everyone)
        assert torch.equal(total.to(torch.int64), exact)
    unsigned = pattern(3, 0, 600, torch.uint8)
    assert int(unsigned.min()) >= 0 and int(unsigned.max()) <= 10
    # Blocks of different ranks at the same place differ, so a misplaced block is seen.
    assert count_wrong(pattern(1, 0, 500, torch.float32), pattern(2, 0, 500, torch.float32)) > 400
    assert not (pattern(0, 0, 300, torch.float32) == SENTINEL).any()


def test_count_wrong_counts_corruption():
    expected = pattern([0, 1], 0, 4096, torch.float32)
    got = expected.clone()
    assert count_wrong(got, expected) == 0
    got[10] += 1
    got[100:110] = float("nan")
    got[-1] = -got[-1] - 1
    assert count_wrong(got, expected) == 12
    assert count_wrong(got[:-1], expected) == 4096  # wrong shape: everything is wrong


def test_plan_skips_with_notes_and_is_deterministic():
    cfg = CommBenchConfig(ops=["all_reduce", "sendrecv", "all_gather"], impls=["torch", "nosuch"],
                          sizes=[4, 1024], dtypes=["float32"])
    points, skipped = plan_points(cfg, 4)
    assert points == plan_points(cfg, 4)[0]
    assert {p.impl for p in points} == {"torch"}
    reasons = {(s["op"], s["impl"]): s["reason"] for s in skipped}
    assert "not registered" in reasons[("all_reduce", "nosuch")]
    # 4 bytes of float32 cannot be split in 4 blocks: skipped, while all_reduce measures it.
    assert "no whole" in reasons[("all_gather", "torch")]
    assert any(p.op == "all_reduce" and p.nbytes == 4 for p in points)
    if "ring" in registered_impls():
        cfg.impls = ["ring"]
        _, skipped = plan_points(cfg, 2)
        assert any(s["op"] == "sendrecv" and "point-to-point" in s["reason"] for s in skipped)


# ------------------------------------------------------------------------------- inside ranks
def _check_every_op(impls: list[str], sabotage: bool, chunk: int | None = None) -> dict:
    """Each op's check on a small point; with `sabotage` the op does nothing, so results are wrong.

    `chunk` shrinks the check's chunk so that chunk boundaries fall inside blocks.
    """
    from shardlab.bench import cases as bench_cases

    if chunk:
        bench_cases._CHUNK = chunk
    results = {}
    for impl in impls:
        points, _ = plan_points(CommBenchConfig(ops=list(OPS), impls=[impl], sizes=[3000], dtypes=["bfloat16"]),
                                dist.get_world_size())
        for point in points:
            case = Case(point, None, torch.device("cpu"))
            if sabotage:
                case.run = lambda: None
            w = torch.tensor([case.check()])
            dist.all_reduce(w)
            results[(point.op, impl)] = int(w)
    bench_cases._CHUNK = 4 * 2**20
    return results


def test_checker_passes_right_results_and_counts_wrong_ones(pools):
    impls = registered_impls()
    for n in (2, 3):
        right = pools(n).run(_check_every_op, impls, False, 97)[0]
        assert right and all(w == 0 for w in right.values()), right
        wrong = pools(n).run(_check_every_op, impls, True)[0]
        # Untouched outputs: every element of every checked rank is wrong (all but the root for broadcast).
        for (op, impl), w in wrong.items():
            assert w > 0, (op, impl, n)


def _measure_small() -> dict:
    from shardlab.bench.comm import measure_point

    cfg = CommBenchConfig(target_s=0.01, min_iters=5, max_iters=7)
    return measure_point(Point("all_reduce", "torch", "float32", 4096, 1024), cfg, None, torch.device("cpu"))


def test_measure_point_agrees_across_ranks(pools):
    rows = pools(2).run(_measure_small)
    assert rows[0]["iters"] == rows[1]["iters"]
    assert rows[0]["time_us"] == rows[1]["time_us"]  # the slowest rank's times, shared
    r = rows[0]
    assert 5 <= r["iters"] <= 7
    assert r["time_us_min"] <= r["time_us_p10"] <= r["time_us"] <= r["time_us_p90"] <= r["time_us_max"]


# --------------------------------------------------------------------------------- end to end
def test_cli_sweep_end_to_end(tmp_path, capfd):
    impls = ["torch"] + (["ring"] if "ring" in registered_impls() else [])
    out_json, out_csv, out_png = tmp_path / "b.json", tmp_path / "b.csv", tmp_path / "b.png"
    code = main(["bench", "comm", "--world-size", "2", "--sizes", "1K,64K", "--impl", ",".join(impls),
                 "--target-time", "0.02", "--min-iters", "5", "--max-iters", "50", "--ceiling-size", "4M",
                 "--json", str(out_json), "--csv", str(out_csv), "--plot", str(out_png), "--timeout", "60"])
    assert code == 0
    printed = capfd.readouterr()  # fd level: the progress lines come from rank 0, a child process
    assert "alpha-beta fits" in printed.out and "[1/" in printed.err

    result = json.loads(out_json.read_text())
    rows = result["rows"]
    measured = {(r["op"], r["impl"]) for r in rows}
    assert {(op, "torch") for op in OPS} <= measured
    if "ring" in impls:
        assert ("all_reduce", "ring") in measured
        assert any(s["op"] == "sendrecv" and s["impl"] == "ring" for s in result["skipped"])
    assert len(rows) == 2 * len(measured)
    for r in rows:
        for key in REQUIRED:
            assert key in r, key
        assert r["wrong"] == 0, r
        n = r["world_size"]
        assert r["algbw_gbps"] == pytest.approx(r["bytes"] / (r["time_us"] * 1e-6) / 1e9, rel=1e-12)
        assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] * busbw_factor(r["op"], n), rel=1e-12)
        assert r["count"] * 4 == r["bytes"]
        assert r["frac_of_p2p"] == pytest.approx(r["busbw_gbps"] / result["ceilings"][0]["p2p_gbps"])
        assert r["frac_of_memcpy"] > 0
    # all_gather's size is the whole gathered buffer, as nccl-tests counts it.
    ag = next(r for r in rows if r["op"] == "all_gather" and r["bytes"] == 1024)
    assert ag["count"] == 256
    ceil = result["ceilings"][0]
    assert ceil["memcpy_gbps"] > 0 and ceil["p2p_gbps"] > 0 and "sendrecv" in ceil["p2p_source"]
    fits = {(f["op"], f["impl"]) for f in result["fits"]}
    assert ("all_reduce", "torch") in fits
    for f in result["fits"]:
        assert f["alpha_us"] >= 0 and "rel_err_max" in f and f["model"]

    with out_csv.open() as f:
        table = list(csv.DictReader(f))
    assert len(table) == len(rows) and list(table[0])[: len(ROW_FIELDS)] == ROW_FIELDS
    assert out_png.stat().st_size > 10_000


def _fail_at_third_point(*args, **kwargs):
    from shardlab.bench import comm as bench_comm

    real = bench_comm.measure_point
    calls = []

    def measure(*a, **k):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("simulated failure at the third point")
        return real(*a, **k)

    bench_comm.measure_point = measure
    return bench_comm.bench_on_ranks(*args, **kwargs)


def test_failed_sweep_keeps_measured_rows(monkeypatch):
    from shardlab.bench import comm as bench_comm
    from shardlab.dist import launch

    def launch_failing(fn, ws, *args, **kwargs):
        return launch(_fail_at_third_point, ws, *args, **kwargs)

    monkeypatch.setattr("shardlab.dist.launch", launch_failing)
    cfg = CommBenchConfig(ops=["all_reduce"], sizes=[1024, 2048, 4096, 8192], world_sizes=[2], target_s=0.01,
                          ceiling_bytes=0, p2p_bytes=0, progress=False)
    result = bench_comm.run_comm_bench(cfg, timeout_s=30)
    assert result["incomplete"] and "simulated failure" in result["error"]
    assert [r["bytes"] for r in result["rows"]] == [1024, 2048]


def test_table_puts_impls_side_by_side():
    rows = []
    for impl, t in (("torch", 100.0), ("ring", 50.0)):
        algbw = 4096 / t / 1e3
        rows.append({"op": "all_reduce", "impl": impl, "world_size": 2, "dtype": "float32", "bytes": 4096,
                     "count": 1024, "time_us": t, "algbw_gbps": algbw, "busbw_gbps": algbw, "wrong": 0})
    text = format_table(rows)
    assert "-- torch" in text and "-- ring" in text and "ring/torch" in text
    assert "2.00x" in text  # ring is twice as fast


def test_cli_rejects_unknown_op_and_impl():
    with pytest.raises(SystemExit):
        main(["bench", "comm", "--ops", "all_reduce,gather"])
    with pytest.raises(SystemExit):
        main(["bench", "comm", "--impl", "nosuch"])
    with pytest.raises(SystemExit):
        main(["bench", "comm", "--sizes", "1Q"])
