"""compute-sanitizer and Nsight Compute around suite stages: commands and the parsing of
their reports."""
from __future__ import annotations

import csv
import io
import re
import shutil

SANITIZER_TOOLS = ("memcheck", "racecheck")
KERNEL = "_multi_chunk_attn_kernel"
# ncu --page details sections; the pipe metrics are asked for separately (their names differ
# between architectures, and ncu refuses the whole run for one unknown name)
NCU_SECTIONS = ("SpeedOfLight", "Occupancy", "LaunchStats", "ComputeWorkloadAnalysis")
NCU_PIPE_METRICS = ("sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active",
                    "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active",
                    "sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active",
                    "sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active",
                    "sm__pipe_xu_cycles_active.avg.pct_of_peak_sustained_active")
NCU_SUMMARY = ("Duration", "Compute (SM) Throughput", "Memory Throughput", "Achieved Occupancy",
               "Theoretical Occupancy", "Registers Per Thread", "Block Limit Registers",
               "Block Limit Shared Mem", "Issue Slots Busy", "Executed Ipc Active", "SM Busy")


def find(tool: str) -> str | None:
    """``tool`` on the PATH or under the CUDA toolkit's usual places."""
    found = shutil.which(tool)
    if found:
        return found
    for root in ("/usr/local/cuda/bin", "/usr/local/cuda/compute-sanitizer", "/opt/nvidia/nsight-compute"):
        hit = shutil.which(tool, path=root)
        if hit:
            return hit
    return None


def sanitizer_command(exe: str, tool: str, program: list[str]) -> list[str]:
    """compute-sanitizer around ``program``: kernel errors only (``--report-api-errors no``:
    the CUDA API errors torch provokes and handles itself, such as probing for peer access or
    an unsupported attribute, are not the kernels' errors)."""
    return [exe, "--tool", tool, "--report-api-errors", "no", "--error-exitcode", "9",
            "--print-limit", "20", "--target-processes", "all", *program]


# one report per CUDA API error (when a run reports them): "Program hit cudaErrorX (error N)
# due to ... on CUDA API call to cuFoo."
_API_ERROR = re.compile(r"Program hit \w+ \(error \d+\) due to .* on CUDA API call to")


def sanitizer_errors(output: str) -> int | None:
    """The kernel errors of compute-sanitizer's summary line (None: no summary found): its count
    less the CUDA API errors reported, should a version report them despite
    ``--report-api-errors no``."""
    m = re.search(r"(?:ERROR|RACECHECK|SYNCCHECK|INITCHECK) SUMMARY: (\d+) (?:errors?|hazards?)", output)
    if m is None:
        return None
    if "RACECHECK SUMMARY" in m.group(0):  # "N hazards displayed (E errors, W warnings)"
        e = re.search(r"\((\d+) errors?", output[m.start():])
        return int(e.group(1)) if e else int(m.group(1))
    return max(0, int(m.group(1)) - len(_API_ERROR.findall(output[:m.start()])))


def racecheck_is_information(sm: int) -> bool:
    """Whether racecheck hazards are information rather than failures on SM version ``sm``:
    from sm_90 on the kernel's pipelined loads are asynchronous (bulk) copies, whose hazard
    reports need reading before they count as races."""
    return sm >= 90


def ncu_command(exe: str, program: list[str], pipes: bool = True) -> list[str]:
    """One launch of the kernel (the second: the first may include a lazy module load),
    clocks as the card runs them (``--clock-control none``: the card's settings stay)."""
    cmd = [exe, "--clock-control", "none", "--target-processes", "all", "-k", f"regex:{KERNEL}",
           "--launch-skip", "1", "--launch-count", "1", "--csv", "--page", "details"]
    for s in NCU_SECTIONS:
        cmd += ["--section", s]
    if pipes:
        cmd += ["--metrics", ",".join(NCU_PIPE_METRICS)]
    return cmd + program


def ncu_metrics(output: str) -> dict[str, str]:
    """``{metric name: "value unit"}`` from ``ncu --csv --page details`` output (the CSV part
    starts at the header line with "Metric Name")."""
    start = output.find('"ID"')
    if start < 0:
        return {}
    out = {}
    for row in csv.DictReader(io.StringIO(output[start:])):
        name, value = row.get("Metric Name"), row.get("Metric Value")
        if name and value is not None:
            unit = row.get("Metric Unit") or ""
            out[name] = f"{value} {unit}".strip()
    return out
