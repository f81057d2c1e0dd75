"""benchmarks/profile_cuda.py's summary of ncu's raw CSV, which runs on the
device machine only once per lease: its parsing and its assignment of kernels
to cases are checked here on a CSV written the way ncu writes it."""
import csv
import io
import json

import pytest

from benchmarks import profile_cuda

METRICS = ["gpu__time_duration.sum", "dram__throughput.avg.pct_of_peak_sustained_elapsed",
           "sm__throughput.avg.pct_of_peak_sustained_elapsed", "smsp__issue_active.avg.pct_of_peak_sustained_active",
           "sm__warps_active.avg.pct_of_peak_sustained_active", "sm__maximum_warps_per_active_cycle_pct",
           "launch__registers_per_thread", "smsp__inst_executed.sum",
           "smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio",
           "smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio",
           "smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio",
           "smsp__average_warps_issue_stalled_wait_per_issue_active.ratio"]
UNITS = ["nsecond", "%", "%", "%", "%", "%", "register/thread", "inst", "", "", "", ""]


def raw_csv(kernels):
    """ncu --csv --page raw --log-file output: ==PROF== lines, header, units, one row per kernel."""
    out = io.StringIO()
    out.write("==PROF== Connected to process 123 (/usr/bin/python3)\n")
    w = csv.writer(out, quoting=csv.QUOTE_ALL, lineterminator="\n")
    w.writerow(["ID", "Kernel Name", "Block Size", "Grid Size", *METRICS])
    w.writerow(["", "", "", "", *UNITS])
    for i, (name, values) in enumerate(kernels):
        w.writerow([str(i), name, "(128, 1, 1)", "(672, 1, 1)", *values])
    out.write("==PROF== Disconnected from process 123\n")
    return out.getvalue()


def write_inputs(tmp_path, kernels, cases):
    raw = tmp_path / "raw.csv"
    raw.write_text(raw_csv(kernels))
    recorded = tmp_path / "kernels.json"
    recorded.write_text(json.dumps(dict(device="NVIDIA H100 80GB HBM3", gpu="h100", cases=cases)))
    return raw, recorded


MMA = ("void lowbit::cuda::(anonymous namespace)::gptq_mma_kernel<4, 1, __half>"
       "(lowbit::cuda::(anonymous namespace)::MmaArgs)")
REDUCE = "void lowbit::cuda::splitk_reduce_kernel(lowbit::cuda::SplitK)"
QUANT = "void lowbit::cuda::(anonymous namespace)::quantize_act<(lowbit::GGMLType)12>(const float *, int)"


def test_rows_are_assigned_to_cases_in_launch_order_with_their_metrics(tmp_path):
    kernels = [
        (MMA, ["41,000", "55.5", "61.2", "48.0", "30.1", "50", "96", "2,000,000", "3.5", "0.5", "1.25", "2.0"]),
        (REDUCE, ["2,500", "10", "5", "3", "40", "100", "16", "1000", "0.1", "", "", ""]),
        (QUANT, ["1500", "1", "2", "3", "4", "5", "32", "10", "", "", "", ""]),
    ]
    cases = [dict(case="gptq 4-bit M=1", kernels=["gptq_mma_kernel", "splitk_reduce_kernel"],
                  weight_bytes=120_000_000, weights=8192 * 28672),
             dict(case="gguf Q4_K M=1", kernels=["quantize_act"], weight_bytes=1, weights=1)]
    raw, recorded = write_inputs(tmp_path, kernels, cases)
    table, note = profile_cuda.summarize(str(raw), str(recorded), str(tmp_path / "out.md"))
    assert note == ""
    assert [(t["case"], t["kernel"]) for t in table] == [
        ("gptq 4-bit M=1", "gptq_mma_kernel"), ("gptq 4-bit M=1", "splitk_reduce_kernel"),
        ("gguf Q4_K M=1", "quantize_act")]
    mma = table[0]
    assert mma["us"] == pytest.approx(41.0)  # nanoseconds, with ncu's thousands separator
    assert mma["gbs"] == pytest.approx(120e6 / 41e-6 / 1e9)
    assert mma["inst_per_weight"] == pytest.approx(2e6 * 32 / (8192 * 28672))
    assert (mma["dram"], mma["sm"], mma["issue"], mma["occupancy"], mma["theoretical"], mma["registers"]) == (
        55.5, 61.2, 48.0, 30.1, 50.0, 96.0)
    assert mma["stalls"] == "long_scoreboard 3.5, wait 2.0, math_pipe_throttle 1.2"
    assert table[2]["stalls"] == ""  # no stall values: none shown
    text = (tmp_path / "out.md").read_text()
    assert "| gptq 4-bit M=1 | `gptq_mma_kernel` | (672, 1, 1) x (128, 1, 1) | 41.0 | 2927 | 56 | 61 |" in text
    assert "NVIDIA H100 80GB HBM3" in text


def test_a_kernel_count_that_differs_from_the_recorded_one_is_said(tmp_path):
    kernels = [(MMA, ["1000"] + [""] * (len(METRICS) - 1))]
    cases = [dict(case="a", kernels=["gptq_mma_kernel", "splitk_reduce_kernel"], weight_bytes=1, weights=1)]
    raw, recorded = write_inputs(tmp_path, kernels, cases)
    table, note = profile_cuda.summarize(str(raw), str(recorded), str(tmp_path / "out.md"))
    assert [t["kernel"] for t in table] == ["gptq_mma_kernel"]
    assert table[0]["dram"] is None and table[0]["inst_per_weight"] is None
    assert "ncu profiled 1 kernels where the cases launch 2" in note
    assert note in (tmp_path / "out.md").read_text()


def test_a_log_without_profiled_kernels_names_the_file(tmp_path):
    raw = tmp_path / "raw.csv"
    raw.write_text("==PROF== Connected to process 1\n==WARNING== No kernels were profiled.\n")
    with pytest.raises(SystemExit, match="raw.csv"):
        profile_cuda.read_raw_csv(str(raw))


def test_the_default_results_file_is_named_after_the_gpu(tmp_path, monkeypatch):
    raw, recorded = write_inputs(tmp_path, [(MMA, ["1000"] + [""] * (len(METRICS) - 1))],
                                 [dict(case="a", kernels=["k"], weight_bytes=1, weights=1)])
    written = {}
    real_open = open

    def fake_open(path, mode="r", *args, **kwargs):
        if "w" in mode and str(path).endswith("-cuda-profile.md"):
            written["path"] = str(path)
            return io.StringIO()
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr("builtins.open", fake_open)
    profile_cuda.summarize(str(raw), str(recorded))
    assert written["path"].endswith("benchmarks/results/h100-cuda-profile.md")


def test_launch_dimensions_come_from_the_launch_metrics_where_the_columns_are_absent(tmp_path):
    text = raw_csv([(MMA, ["1000"] + [""] * (len(METRICS) - 1))])
    text = text.replace('"Block Size","Grid Size"', '"launch__block_size","launch__grid_size"')
    text = text.replace('"(128, 1, 1)","(672, 1, 1)"', '"128","672"')
    raw = tmp_path / "raw.csv"
    raw.write_text(text)
    recorded = tmp_path / "kernels.json"
    recorded.write_text(json.dumps(dict(device="d", gpu="h100", cases=[dict(case="a", kernels=["k"], weight_bytes=1,
                                                                            weights=1)])))
    table, _ = profile_cuda.summarize(str(raw), str(recorded), str(tmp_path / "out.md"))
    assert (table[0]["grid"], table[0]["block"]) == ("672", "128")
