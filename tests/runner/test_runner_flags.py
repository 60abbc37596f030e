"""Every `horovodrun` 0.28.1 flag, as `hora run` takes it: it works, or it stops with one line."""

from __future__ import annotations

import re
import sys
import textwrap

import pytest

from hora import config
from hora.cli import main
from hora.runner.commands.run_args import build_parser, knob_environment, parse_run_args

pytestmark = pytest.mark.timeout(30)

PY = sys.executable

# Every option string of horovodrun 0.28.1's argument parser (horovod/runner/launching/launch.py).
HOROVODRUN_OPTIONS = (
    "-h --help -v --version -np --num-proc -cb --check-build --disable-cache --start-timeout "
    "--network-interfaces --network-interface --output-filename --verbose --config-file "
    "-p --ssh-port -i --ssh-identity-file --fusion-threshold-mb --cycle-time-ms --cache-capacity "
    "--hierarchical-allreduce --no-hierarchical-allreduce --hierarchical-allgather "
    "--no-hierarchical-allgather --autotune --no-autotune --autotune-log-file "
    "--autotune-warmup-samples --autotune-steps-per-sample --autotune-bayes-opt-max-samples "
    "--autotune-gaussian-process-noise --min-np --min-num-proc --max-np --max-num-proc "
    "--slots-per-host --elastic-timeout --reset-limit --blacklist-cooldown-range "
    "--timeline-filename --timeline-mark-cycles --no-timeline-mark-cycles --no-stall-check "
    "--stall-check --stall-check-warning-time-seconds --stall-check-shutdown-time-seconds "
    "--mpi-threads-disable --no-mpi-threads-disable --mpi-args --tcp --binding-args "
    "--num-nccl-streams --thread-affinity --gloo-timeout-seconds --log-level --log-with-timestamp "
    "--log-without-timestamp -prefix-timestamp --prefix-output-with-timestamp --log-hide-timestamp "
    "--no-log-hide-timestamp -H --hosts -hostfile --hostfile --host-discovery-script --gloo --mpi "
    "--jsrun"
).split()


def _one_error_line(capsys, argv: list[str]) -> str:
    """Run `hora run ARGV true`, expect exit status 2 and exactly one line on stderr; return it."""
    assert main(["run", *argv, "true"]) == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("hora run: error: "), lines[0]
    assert captured.out == ""
    return lines[0]


def test_every_horovodrun_option_is_known_to_hora_run():
    known = set(build_parser()._option_string_actions)
    missing = [option for option in HOROVODRUN_OPTIONS if option not in known]
    assert missing == []


@pytest.mark.parametrize("flags, fragment", [
    (["--slots-per-host", "2"], "--slots-per-host: only applies to elastic jobs"),
    (["--elastic-timeout", "60"], "--elastic-timeout: only applies to elastic jobs"),
    (["--reset-limit", "3"], "--reset-limit: only applies to elastic jobs"),
    (["--blacklist-cooldown-range", "10", "100"], "--blacklist-cooldown-range: only applies to elastic"),
    (["--min-np", "3", "--max-np", "2"], "--min-np 3 is greater than --max-np 2"),
    (["--min-np", "3"], "-np 2 is outside the elastic bounds"),
    (["--jsrun"], "--jsrun: hora cannot start workers through jsrun"),
    (["--binding-args=--rankfile f"], "--binding-args: process binding is done by mpirun"),
    (["--num-nccl-streams", "2"],
     "--num-nccl-streams: hora runs every NCCL collective of a process on one CUDA stream"),
    (["--thread-affinity", "3"], "--thread-affinity: hora does not pin its background thread"),
    (["--hierarchical-allgather"], "--hierarchical-allgather: hora has no hierarchical allgather"),
    (["--log-with-timestamp"], "--log-with-timestamp: hora's log lines carry no timestamp"),
    (["--no-log-hide-timestamp"], "--log-with-timestamp: hora's log lines carry no timestamp"),
    (["--gloo", "--mpi"], "not allowed with argument --gloo"),
    (["--hierarchical-allreduce", "--no-hierarchical-allreduce"], "not allowed with"),
    (["--gloo-timeout-seconds", "0"], "--gloo-timeout-seconds: must be a positive number"),
    (["--autotune-gaussian-process-noise", "2"], "must be a number in [0, 1]"),
    (["--config-file", "/nonexistent/horovod.yaml"], "--config-file: cannot read"),
])
def test_flags_hora_cannot_honour_stop_with_one_line(capsys, flags, fragment):
    line = _one_error_line(capsys, ["-np", "2", *flags])
    assert fragment in line


@pytest.mark.parametrize("flags, expected", [
    (["--hierarchical-allreduce"], {"HIERARCHICAL_ALLREDUCE": "1"}),
    (["--no-hierarchical-allreduce"], {"HIERARCHICAL_ALLREDUCE": "0"}),
    (["--no-autotune"], {"AUTOTUNE": "0"}),
    (["--autotune", "--autotune-log-file", "a.csv", "--autotune-warmup-samples", "2",
      "--autotune-steps-per-sample", "5", "--autotune-bayes-opt-max-samples", "9",
      "--autotune-gaussian-process-noise", "0.5"],
     {"AUTOTUNE": "1", "AUTOTUNE_LOG": "a.csv", "AUTOTUNE_WARMUP_SAMPLES": "2", "AUTOTUNE_STEPS_PER_SAMPLE": "5",
      "AUTOTUNE_BAYES_OPT_MAX_SAMPLES": "9", "AUTOTUNE_GAUSSIAN_PROCESS_NOISE": "0.5"}),
    (["--no-timeline-mark-cycles"], {"TIMELINE_MARK_CYCLES": "0"}),
    (["--stall-check"], {"STALL_CHECK_DISABLE": "0"}),
    (["--no-stall-check"], {"STALL_CHECK_DISABLE": "1"}),
    (["--gloo-timeout-seconds", "45"], {"TRANSPORT_TIMEOUT": "45.0"}),
    (["--start-timeout", "9"], {"START_TIMEOUT": "9.0"}),
])
def test_flags_that_map_to_knobs_set_both_spellings(flags, expected):
    args = parse_run_args(["-np", "2", *flags, "python", "x.py"])
    env = knob_environment(args)
    for name, value in expected.items():
        assert env[f"HORA_{name}"] == value, name
        if config.knob(name.lower()).alias:
            assert env[f"HOROVOD_{name}"] == value, name


@pytest.mark.parametrize("flags", [
    ["--gloo"], ["--disable-cache"], ["--no-hierarchical-allgather"], ["--mpi-threads-disable"],
    ["--no-mpi-threads-disable"], ["--log-without-timestamp"], ["--log-hide-timestamp"],
    ["-prefix-timestamp"], ["--prefix-output-with-timestamp"], ["--verbose"], ["--tcp"],
])
def test_flags_already_true_of_hora_are_accepted(flags):
    args = parse_run_args(["-np", "2", *flags, "python", "x.py"])
    assert args.command == ["python", "x.py"]


@pytest.mark.parametrize("value, expected", [("fp16", "fp16"), ("PowerSGD:4", "powersgd:4"),
                                             ("powersgd:8:100", "powersgd:8:100"), ("none", "none"),
                                             ("TopK", "topk"), ("topk:0.01", "topk:0.01"), ("topk:1", "topk:1.0")])
def test_compression_flag_sets_hora_compression_only(value, expected):
    env = knob_environment(parse_run_args(["-np", "2", "--compression", value, "python", "x.py"]))
    assert env == {"HORA_COMPRESSION": expected}  # hora's own knob: Horovod has no such variable
    assert "HORA_COMPRESSION" not in knob_environment(parse_run_args(["-np", "2", "python", "x.py"]))


@pytest.mark.parametrize("value", ["powersgd:0", "topk:0", "topk:1.5", "topk:x", "topk:0.1:2"])
def test_bad_compression_flag_stops_with_one_line_listing_the_forms(capsys, value):
    line = _one_error_line(capsys, ["-np", "1", "--compression", value])
    assert "--compression" in line and "none, fp16, bf16, powersgd[:RANK[:START_ITER]] or topk[:RATIO]" in line


def test_compression_flag_is_documented_in_hora_run_help():
    action = build_parser()._option_string_actions["--compression"]
    assert "HORA_COMPRESSION" in action.help and "powersgd[:RANK[:START_ITER]]" in action.help


COMPRESSION_SCRIPT = """
import logging
import torch
import hora.torch as hvd
logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")
hvd.init()
model = torch.nn.Linear(3, 2)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                               named_parameters=model.named_parameters())
model(torch.ones(4, 3)).sum().backward()
opt.step()
print("compression", opt._compression.__name__)
hvd.shutdown()
"""


@pytest.mark.skipif(__import__("importlib").util.find_spec("torch") is None, reason="torch is not installed")
def test_compression_flag_reaches_a_workers_distributed_optimizer(hora_run, tmp_path):
    script = tmp_path / "train.py"
    script.write_text(COMPRESSION_SCRIPT)
    result = hora_run("run", "-np", "1", "--compression", "fp16", "--log-level", "INFO", PY, str(script))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("compression FP16Compressor"), result.stdout
    picked = [line for line in result.stderr.splitlines() if "HORA_COMPRESSION=fp16" in line]
    assert len(picked) == 1 and "INFO" in picked[0] and "Compression.fp16" in picked[0], result.stderr


def test_tcp_flag_disables_infiniband_for_nccl_as_horovod_does():
    args = parse_run_args(["-np", "2", "--tcp", "python", "x.py"])
    assert knob_environment(args)["NCCL_IB_DISABLE"] == "1"


def test_network_interface_flags_accumulate_in_order():
    args = parse_run_args(["-np", "2", "--network-interface", "eth0", "--network-interfaces",
                           "ib0,eth0", "--network-interface", "lo", "python", "x.py"])
    assert args.network_interfaces == ["eth0", "ib0", "lo"]


def test_check_build_short_flag_needs_no_np(capsys):
    assert main(["run", "-cb"]) == 0
    assert "tcp ring:" in capsys.readouterr().out


def test_version_flag_prints_hora_version(capsys):
    assert main(["run", "-v"]) == 0
    assert re.fullmatch(r"hora \d+\.\d+\.\d+\n", capsys.readouterr().out)


@pytest.mark.parametrize("flags, fragment", [
    (["--fusion-threshold", "64"], "unknown option --fusion-threshold (did you mean --fusion-threshold-mb?)"),
    (["--bogus"], "unknown option --bogus"),
    (["-x", "NCCL_DEBUG=INFO"], "unknown option -x"),
])
def test_unknown_option_is_named_in_one_line(capsys, flags, fragment):
    line = _one_error_line(capsys, ["-np", "2", *flags])
    assert fragment in line
    assert "hora run --help" in line


# ---- --config-file (Horovod's YAML schema) ---------------------------------------------------------

CONFIG = """
controller: gloo
params:
  fusion_threshold_mb: 32
  cycle_time_ms: 2.5
  cache_capacity: 512
  hierarchical_allreduce: true
  hierarchical_allgather: false
autotune:
  enabled: false
timeline:
  filename: /tmp/timeline.json
  mark_cycles: true
stall_check:
  enabled: false
  warning_time_seconds: 30
  shutdown_time_seconds: 90
library_options:
  mpi_threads_disable: true
  gloo_timeout_seconds: 40
logging:
  level: debug
  with_timestamp: false
"""


def _config(tmp_path, text: str) -> str:
    path = tmp_path / "horovod.yaml"
    path.write_text(textwrap.dedent(text))
    return str(path)


needs_yaml = pytest.mark.skipif(
    __import__("importlib").util.find_spec("yaml") is None, reason="PyYAML (hora[yaml]) is not installed")


@needs_yaml
def test_config_file_sets_the_same_knobs_as_flags(tmp_path):
    args = parse_run_args(["-np", "2", "--config-file", _config(tmp_path, CONFIG), "python", "x.py"])
    env = knob_environment(args)
    expected = {
        "FUSION_THRESHOLD": str(32 * 1024 * 1024), "CYCLE_TIME": "2.5", "CACHE_CAPACITY": "512",
        "HIERARCHICAL_ALLREDUCE": "1", "AUTOTUNE": "0", "TIMELINE": "/tmp/timeline.json",
        "TIMELINE_MARK_CYCLES": "1", "STALL_CHECK_DISABLE": "1", "STALL_CHECK_TIME_SECONDS": "30.0",
        "STALL_SHUTDOWN_TIME_SECONDS": "90.0", "LOG_LEVEL": "DEBUG", "TRANSPORT_TIMEOUT": "40.0",
    }
    for name, value in expected.items():
        assert env[f"HORA_{name}"] == value, name
    assert args.use_gloo is True


@needs_yaml
def test_command_line_flags_win_over_the_config_file(tmp_path):
    path = _config(tmp_path, CONFIG)
    for argv in (["--cycle-time-ms", "7", "--config-file", path], ["--config-file", path, "--cycle-time-ms", "7"]):
        env = knob_environment(parse_run_args(["-np", "2", *argv, "python", "x.py"]))
        assert env["HORA_CYCLE_TIME"] == "7.0"
        assert env["HORA_CACHE_CAPACITY"] == "512"


@needs_yaml
@pytest.mark.parametrize("text, fragment", [
    ("controller: nccl\n", "controller: must be gloo or mpi, got 'nccl'"),
    ("params:\n  fusion_threshold_mb: lots\n", "params.fusion_threshold_mb: must be a non-negative number"),
    ("params:\n  hierarchical_allgather: true\n", "params.hierarchical_allgather: hora has no hierarchical"),
    ("params:\n  fusion_threshold: 64\n", "params.fusion_threshold: unknown setting"),
    ("timeline:\n  mark_cycles: maybe\n", "timeline.mark_cycles: must be true or false"),
    ("library_options:\n  num_nccl_streams: 2\n",
     "library_options.num_nccl_streams: hora runs every NCCL collective of a process on one CUDA stream"),
    ("logging:\n  with_timestamp: true\n", "logging.with_timestamp: hora's log lines carry no timestamp"),
    ("logging:\n  level: LOUD\n", "logging.level: must be one of"),
    ("tuning: {}\n", "tuning: unknown section"),
    ("params: [1, 2]\n", "params: must be a mapping"),
    ("- just\n- a list\n", "must hold a mapping"),
    ("params: {fusion_threshold_mb: [\n", "is not valid YAML"),
])
def test_config_file_problems_stop_with_one_line(capsys, tmp_path, text, fragment):
    path = _config(tmp_path, text)
    line = _one_error_line(capsys, ["-np", "2", "--config-file", path])
    assert f"--config-file {path}: " in line
    assert fragment in line


@needs_yaml
def test_config_file_reaches_the_workers_world_size_2(hora_run, tmp_path):
    path = _config(tmp_path, CONFIG)
    result = hora_run("run", "-np", "2", "--config-file", path, "--gloo", "--disable-cache",
                      "--prefix-output-with-timestamp", PY, "-c",
                      "import os; print(os.environ['HOROVOD_FUSION_THRESHOLD'], os.environ['HORA_CYCLE_TIME'])")
    assert result.returncode == 0, result.stderr
    lines = sorted(result.stdout.splitlines(), key=lambda line: line.split(" [", 1)[1])
    assert len(lines) == 2
    for rank, line in enumerate(lines):
        assert re.fullmatch(rf"\d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{{3}} \[{rank}\]<stdout>:33554432 2\.5", line)


def test_config_file_without_pyyaml_says_how_to_get_it(capsys, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "yaml", None)  # as if PyYAML were not installed
    path = _config(tmp_path, CONFIG)
    line = _one_error_line(capsys, ["-np", "2", "--config-file", path])
    assert "reading YAML needs PyYAML (pip install pyyaml" in line


def test_verbose_says_why_accepted_flags_change_nothing(hora_run):
    result = hora_run("run", "-np", "1", "--verbose", "--gloo", "--disable-cache",
                      "--mpi-threads-disable", PY, "-c", "pass")
    assert result.returncode == 0, result.stderr
    assert "--gloo: hora's built-in controller, its only one, plays Gloo's part" in result.stderr
    assert "--disable-cache: hora keeps no cache of its start-up checks" in result.stderr
    assert "--mpi-threads-disable: hora's MPI transport needs MPI_THREAD_MULTIPLE" in result.stderr
