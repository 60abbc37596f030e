"""Smoke tests of ``hora bench`` and benchmarks/compare_allreduce.py on tiny sweeps (world size 2)."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from job_env import clean_env

from hora.bench.cli import main as bench_main
from hora.bench.sweep import OPS, bus_factor, iteration_plan, parse_size, size_sweep

REPO = Path(__file__).resolve().parents[2]
COMPARE = REPO / "benchmarks" / "compare_allreduce.py"
ROW_KEYS = {"op", "size", "count", "dtype", "time_us", "algbw", "busbw", "iters", "ranks", "transport"}
TINY = ["-np", "2", "-b", "4", "-e", "4K", "-f", "16", "--iters", "3", "--warmup", "1"]


def _check_row(row: dict, ranks: int) -> None:
    assert ROW_KEYS <= set(row), row
    assert row["ranks"] == ranks and row["transport"] == "auto" and row["dtype"] == "float32", row
    assert row["count"] * 4 == row["size"], row
    assert row["iters"] >= 1, row
    assert 0 < row["time_us"] < 5e6, row
    assert math.isclose(row["algbw"], row["size"] / row["time_us"] / 1e3, rel_tol=1e-6), row
    assert math.isclose(row["busbw"], row["algbw"] * bus_factor(row["op"], ranks), rel_tol=1e-6), row


# ---- the pieces ------------------------------------------------------------------------------------


@pytest.mark.timeout(10)
def test_bus_factors_follow_nccl_tests() -> None:
    assert bus_factor("allreduce", 4) == pytest.approx(1.5)
    assert bus_factor("allgather", 4) == pytest.approx(0.75)
    assert bus_factor("reducescatter", 2) == pytest.approx(0.5)
    assert bus_factor("alltoall", 3) == pytest.approx(2 / 3)
    assert bus_factor("broadcast", 8) == 1.0
    with pytest.raises(ValueError):
        bus_factor("gather", 2)


@pytest.mark.timeout(10)
def test_sizes_and_iteration_plan() -> None:
    assert parse_size("4") == 4
    assert parse_size("64K") == 64 * 1024
    assert parse_size("64M") == parse_size("64MiB") == parse_size("64mb") == 64 * 1024 * 1024
    assert parse_size("1G") == 1024**3
    with pytest.raises(ValueError):
        parse_size("12Q")
    assert size_sweep(4, 64, 2) == [4, 8, 16, 32, 64]
    assert size_sweep(4, 100, 4) == [4, 16, 64]
    with pytest.raises(ValueError):
        size_sweep(8, 4, 2)
    assert iteration_plan(4, 50, 5) == (50, 5)
    big_iters, big_warmup = iteration_plan(64 * 1024 * 1024, 50, 5)
    assert 1 <= big_iters < 50 and 1 <= big_warmup <= 5


# ---- hora bench --------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_hora_bench_prints_a_table_per_collective() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "hora", "bench", *TINY], capture_output=True, text=True, timeout=50, env=clean_env()
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for op in OPS:
        assert f"# {op}" in out, out
    headers = [line for line in out.splitlines() if "busbw(GB/s)" in line and line.startswith("#")]
    assert len(headers) == len(OPS), out
    for title in ("size(B)", "count", "type", "time(us)", "algbw(GB/s)", "busbw(GB/s)"):
        assert title in headers[0], headers[0]
    rows = [line.split() for line in out.splitlines() if line.strip() and not line.startswith("#")]
    assert len(rows) == 3 * len(OPS), out  # sizes 4, 64, 1024 for each collective
    for cells in rows:
        size, count, dtype, time_us, algbw, busbw, iters = cells
        assert (int(size), int(count), dtype) in {(4, 1, "float32"), (64, 16, "float32"), (1024, 256, "float32")}
        assert float(time_us) > 0 and float(algbw) >= 0 and float(busbw) >= 0 and int(iters) == 3, cells


@pytest.mark.timeout(60)
def test_hora_bench_json_rows(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    for key in [k for k in os.environ if k.startswith(("HORA_", "HOROVOD_"))]:
        monkeypatch.delenv(key)
    assert bench_main([*TINY, "--ops", "allreduce,alltoall", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["op"], r["size"]) for r in rows] == [
        (op, size) for op in ("allreduce", "alltoall") for size in (4, 64, 1024)
    ]
    for row in rows:
        _check_row(row, ranks=2)
        assert len(row["per_rank_time_us"]) == 2 and max(row["per_rank_time_us"]) == pytest.approx(row["time_us"])


@pytest.mark.timeout(60)
def test_hora_bench_inside_a_job_reports_once() -> None:
    """Started by ``hora run -np 2``, the bench runs in place and only rank 0 prints its rows."""
    proc = subprocess.run(
        [sys.executable, "-m", "hora", "run", "-np", "2", sys.executable, "-m", "hora", "bench",
         "--ops", "broadcast", "-b", "64", "-e", "64", "--iters", "2", "--json"],
        capture_output=True, text=True, timeout=50, env=clean_env(),
    )
    assert proc.returncode == 0, proc.stderr
    # The launcher prefixes each worker line with "[rank]<stdout>:".
    lines = [re.sub(r"^\[(\d+)\]<stdout>:", "", line) for line in proc.stdout.splitlines()]
    assert all(line.startswith("[0]") for line in proc.stdout.splitlines() if line.startswith("[")), proc.stdout
    rows = json.loads("\n".join(lines))
    assert len(rows) == 1
    _check_row(rows[0], ranks=2)


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "bad",
    [["-e", "1X"], ["--ops", "allreduce,gather"], ["--dtype", "complex64"], ["-b", "64", "-e", "4"], ["-np", "0"]],
)
def test_hora_bench_rejects_bad_arguments(bad: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        bench_main(bad)
    assert info.value.code == 2
    assert "error" in capsys.readouterr().err


# ---- benchmarks/compare_allreduce.py -----------------------------------------------------------------


@pytest.mark.timeout(180)
def test_compare_allreduce_prints_ratios() -> None:
    """Six libraries; all but MPI take their turns in one job (--shared-workers), so that the workers
    import torch once rather than once per torch job: the table is what is checked, not the speeds."""
    pytest.importorskip("torch")
    proc = subprocess.run(
        [sys.executable, str(COMPARE), "--sizes", "4,65536", "--rounds", "1", "--iters", "5", "--warmup", "1",
         "--shared-workers"],
        capture_output=True, text=True, timeout=170, env=clean_env(), cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr + proc.stdout
    lines = proc.stdout.splitlines()
    header = next(line for line in lines if "size(B)" in line)
    for title in ("hora(us)", "np(us)", "torch(us)", "tcp(us)", "gloo(us)", "mpi(us)", "bw np/gloo", "bw t/mpi",
                  "lat np/gloo", "lat t/mpi"):
        assert title in header, header
    rows = {int(line.split()[0]): line.split() for line in lines if line.strip() and line.split()[0].isdigit()}
    assert sorted(rows) == [4, 65536], proc.stdout
    mpi_skipped = "skipping mpi" in proc.stdout
    names = ["size", "hora_us", "np_us", "torch_us", "tcp_us", "gloo_us", "mpi_us", "hora_bw", "np_bw", "np_oop_bw",
             "torch_bw", "torch_oop_bw", "tcp_bw", "gloo_bw", "mpi_bw", "bw_np/gloo", "bw_np/mpi", "bw_t/gloo",
             "bw_t/mpi", "lat_np/gloo", "lat_t/gloo", "lat_np/mpi", "lat_t/mpi"]
    for cells in rows.values():
        assert len(cells) == len(names), cells
        values = dict(zip(names, cells))
        assert all(float(values[k]) > 0 for k in ("hora_us", "np_us", "torch_us", "tcp_us", "gloo_us")), cells
        for mine, short in (("np", "np"), ("torch", "t")):
            assert float(values[f"lat_{short}/gloo"]) == pytest.approx(
                float(values[f"{mine}_us"]) / float(values["gloo_us"]), rel=0.02, abs=0.01), cells
            assert float(values[f"bw_{short}/gloo"]) > 0, cells
        assert (values["mpi_us"] == "-") == mpi_skipped, proc.stdout


# ---- benchmarks/engine_fusion.py and benchmarks/torch_vs_ddp.py ----------------------------------------
# The closing notes report these two before and after every engine change: they must keep running.


@pytest.mark.timeout(120)
def test_engine_fusion_benchmark_reports_its_ratios() -> None:
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "engine_fusion.py"), "--steps", "5", "--warmup", "1",
         "--rounds", "1", "--json"],
        capture_output=True, text=True, timeout=110, env=clean_env(), cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr + proc.stdout
    report = json.loads(proc.stdout)
    assert report["world_size"] == 2 and report["steps"] == 5
    for key in ("fused_64x4KiB_us", "grouped_64x4KiB_us", "single_256KiB_us", "raw_transport_256KiB_us"):
        assert report[key] > 0, report
    assert report["ratio_fused_over_single"] == pytest.approx(
        report["fused_64x4KiB_us"] / report["single_256KiB_us"], rel=0.01), report


@pytest.mark.timeout(300)
def test_torch_vs_ddp_benchmark_trains_with_every_contender() -> None:
    """Every contender trains issue 17's mlp200 (its first steps cost a fraction of resnet18's, which
    tests/examples trains through the text report), each in its turn inside one pair of workers
    (--shared-workers: torch is imported twice instead of five times)."""
    pytest.importorskip("torch")
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "torch_vs_ddp.py"), "--model", "mlp200", "--iters", "2",
         "--warmup", "1", "--rounds", "1", "--image-size", "32", "--batch-size", "4", "--shared-workers", "--json"],
        capture_output=True, text=True, timeout=290, env=clean_env(), cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr + proc.stdout
    report = json.loads(proc.stdout)
    assert report["shared_workers"] is True and report["config"]["model"] == "mlp200"
    assert set(report["runs"]) == {"hora", "ddp", "single"}, report["runs"].keys()
    for name, runs in report["runs"].items():
        assert len(runs) == 1 and runs[0]["img_sec_total"] > 0, (name, runs)
    assert report["runs"]["hora"][0]["tensors"] == 200, report["runs"]["hora"]


@pytest.mark.timeout(150)
def test_elastic_recovery_benchmark_measures_a_kill_and_the_resumed_step() -> None:
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "elastic_recovery.py"), "--mb", "0.1", "--steps", "5",
         "--kill-at", "2", "--json", "--timeout", "120"],
        capture_output=True, text=True, timeout=140, env=clean_env(), cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr + proc.stdout
    (row,) = json.loads(proc.stdout)
    assert row["mb"] == 0.1
    # Each phase follows the one before it, on the survivors' clock against the killed worker's.
    assert 0 < row["detect"] and 0 < row["reform"] and 0 < row["resume"], row
    assert row["total"] == pytest.approx(row["detect"] + row["reform"] + row["resume"], rel=1e-6), row


@pytest.mark.timeout(300)
def test_spark_estimator_benchmark_times_fit_and_the_same_training_under_hora_run() -> None:
    """One process in each place (--num-proc 1: one Spark task slot, one hora.run worker, each
    importing torch): the timings and the identical histories are what is checked; tests/spark
    trains the estimator on several processes."""
    pytest.importorskip("pyspark")
    pytest.importorskip("sklearn")
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "spark_estimator.py"), "--epochs", "1", "--num-proc", "1",
         "--json"],
        capture_output=True, text=True, timeout=280, env=clean_env(), cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 1, proc.stdout
    row = rows[0]
    assert row["same_history"] == 1.0, row  # the same function on the same data in both places
    assert all(row[key] > 0 for key in ("fit_s", "write_s", "spark_train_s", "hora_run_train_s")), row


@pytest.mark.timeout(150)
def test_autotune_vs_grid_benchmark_tunes_and_compares() -> None:
    """The grid, the tuning and the comparison, in two jobs instead of five (--shared-workers)."""
    pytest.importorskip("sklearn")
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "autotune_vs_grid.py"), "--quick", "--steps", "3",
         "--rounds", "1", "--shared-workers", "--json"],
        capture_output=True, text=True, timeout=140, env=clean_env(), cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr + proc.stdout
    report = json.loads(proc.stdout[proc.stdout.index("{"):])
    assert len(report["grid_mb_per_s"]) == 2 and report["autotune_log_rows"] == 4 + 1 + 1
    assert report["tuned_mb_per_s"] > 0 and report["ratio_tuned_to_best"] > 0


@pytest.mark.timeout(240)
def test_lightning_vs_ddp_benchmark_trains_with_both_strategies() -> None:
    """Both strategies take their turn in one pair of workers (--shared-workers), which import
    Lightning once instead of once per strategy."""
    pytest.importorskip("lightning")
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "lightning_vs_ddp.py"), "--layers", "2", "--steps", "3",
         "--warmup", "1", "--rounds", "1", "--shared-workers", "--json"],
        capture_output=True, text=True, timeout=230, env=clean_env(), cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr + proc.stdout
    report = json.loads(proc.stdout[proc.stdout.index("{"):])
    assert report["hora_median"] > 0 and report["ddp_median"] > 0 and report["gradient_tensors"] == 6


@pytest.mark.timeout(200)
def test_compression_accuracy_benchmark_reports_hora_topk_and_ddps_powersgd_hook() -> None:
    """One epoch of the two paths that differ most (hora's top-k reducer; DDP with its PowerSGD hook
    from the first steps): each trains and reports; the bytes fraction is hora's reducer's."""
    pytest.importorskip("torch")
    pytest.importorskip("sklearn")
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "compression_accuracy.py"), "--epochs", "1", "--start-iter", "2",
         "--only", "hora-topk,ddp-powersgd", "--json"],
        capture_output=True, text=True, timeout=190, env=clean_env(), cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout
    report = json.loads(proc.stdout)
    assert set(report["results"]) == {"hora-topk", "ddp-powersgd"}, report
    for row in report["results"].values():
        assert 10.0 < row["accuracy"] <= 100.0 and row["seconds"] > 0, row  # better than chance after an epoch
    assert 0 < report["results"]["hora-topk"]["sent_fraction"] < 0.05, report


@pytest.mark.timeout(200)
def test_zero_memory_benchmark_reports_sharded_state_and_speed_side_by_side() -> None:
    """Both parts at their smallest: the 201.6 MB Adam state at 2 ranks, unsharded and sharded by
    hora's stage 2 (state and gradients), and two timed steps of the 200-tensor MLP each."""
    pytest.importorskip("torch")
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "zero_memory.py"), "--np", "2", "--models", "mlp200",
         "--rounds", "1", "--steps", "2", "--warmup", "1", "--only", "hora,hora-stage2", "--json"],
        capture_output=True, text=True, timeout=190, env=clean_env(), cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout
    report = json.loads(proc.stdout)
    rows = report["memory"]["2"]
    assert rows["hora"]["state_bytes"] == pytest.approx(201.6e6, rel=1e-3)  # Adam's two moments, whole
    assert rows["hora"]["gradient_bytes"] == pytest.approx(100.8e6, rel=1e-3)
    sharded = rows["hora-stage2"]
    assert 0.45 < sharded["state_fraction"] <= 0.55, rows  # half of each on the largest rank
    assert 0.45 < sharded["gradient_fraction"] <= 0.55, rows
    assert sharded["within_bar"] == 1.0
    assert all(row["peak_rss_growth"] > 0 for row in rows.values()), rows
    speed = report["speed"]["mlp200"]
    assert all(speed[c]["img_sec"] > 0 for c in ("hora", "hora-stage2")), speed
    assert set(speed["ratios"]) == {"hora-stage2/hora"}, speed


@pytest.mark.timeout(120)
def test_zero_same_result_benchmark_compares_the_sharded_weights_with_the_unsharded() -> None:
    """Four steps at 3 ranks (uneven shards), stage 2 against unsharded hora: within the bar, every
    rank alike; and a checkpoint consolidated at 3 ranks halfway continues at 2 on the same curve."""
    pytest.importorskip("torch")
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "zero_same_result.py"), "--np", "3", "--steps", "4",
         "--only", "hora-stage2", "--resume", "3,2", "--json"],
        capture_output=True, text=True, timeout=110, env=clean_env(), cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout
    report = json.loads(proc.stdout)
    assert set(report["results"]) == {"3/adam", "3/sgd-momentum"}
    for rows in report["results"].values():
        assert set(rows) == {"hora", "hora-stage2"}
        assert rows["hora"]["max_abs_diff"] == 0.0
        row = rows["hora-stage2"]
        assert row["max_abs_diff"] <= report["bar"] and row["within_bar"] == 1.0 and row["ranks_agree"] == 1.0, rows
    # saved at 3 ranks after 2 steps, resumed at 2: the loss curve of the uninterrupted run at 3
    resumed = report["resume"]["3->2/adam/hora-stage2"]
    assert resumed["max_rel_loss_diff"] < 1e-5 and resumed["within_bar"] == 1.0, resumed


@pytest.mark.timeout(200)
def test_compression_bytes_benchmark_counts_powersgds_bytes_on_the_wire() -> None:
    """Two steps of the 200-tensor MLP over TCP, uncompressed and with PowerSGD: the transports'
    counters see the uncompressed gradient (a 2-rank ring sends each rank's whole buffer once) and a
    small fraction of it compressed, in line with what the reducer planned."""
    pytest.importorskip("torch")
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "compression_bytes.py"), "--models", "mlp200", "--only",
         "none,powersgd", "--steps", "2", "--warmup", "2", "--json"],
        capture_output=True, text=True, timeout=190, env=clean_env(), cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout
    rows = json.loads(proc.stdout)["results"]["mlp200"]
    none, compressed = rows["none"], rows["powersgd"]
    assert none["gradient_bytes"] <= none["bytes_per_step"] <= none["gradient_bytes"] * 1.01, none
    assert compressed["fraction_of_none"] < 0.1, compressed
    assert compressed["fraction_of_none"] == pytest.approx(compressed["reducer_fraction"], rel=0.05), compressed
