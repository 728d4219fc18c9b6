"""The Slurm job scripts of examples/slurm/: they parse, env.sh derives the topology and the
network variables, and their launch lines build the topology the strategies detect.

Slurm itself is not here: a stand-in ``srun`` runs its command once per machine on this host
(``SLURM_NODEID`` set per copy) and ``scontrol show hostnames`` names this host for every
machine. ``check.sbatch`` then runs for real: two torchrun agents meet at the c10d rendezvous
and start 2 ranks each on CPU (gloo), and ``swiftfusion check`` detects 2 machines x 2 GPUs
from the launcher. The xFuser runner and ``xdit`` need GPUs and checkpoints: their command
lines are recorded by stand-ins and checked against what xFuser and our detection derive.
"""
import json
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from xfuser_swiftfusion.emulation.launcher import free_port
from xfuser_swiftfusion.integrations.xfuser.args import xdit_nproc
from xfuser_swiftfusion.topology import Topology

SLURM = Path(__file__).resolve().parents[1] / "examples" / "slurm"
SCRIPTS = sorted(SLURM.glob("*.sbatch"))

SRUN = """#!/bin/bash
# stand-in for srun: the command once per machine, here; machine i's output in $SRUN_OUT/node$i.out
nodes="${SLURM_JOB_NUM_NODES:-1}"
while [[ "${1:-}" == --* ]]; do [[ "$1" == --nodes=* ]] && nodes="${1#--nodes=}"; shift; done
pids=()
for ((i = 0; i < nodes; i++)); do
    SLURM_NODEID=$i SLURM_PROCID=$i SLURM_LOCALID=0 "$@" >"$SRUN_OUT/node$i.out" 2>&1 &
    pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=$?; done
exit $rc
"""
SCONTROL = """#!/bin/bash
# stand-in for `scontrol show hostnames`: every machine is this host
for ((i = 0; i < ${SLURM_JOB_NUM_NODES:-1}; i++)); do echo 127.0.0.1; done
"""
RECORD = """#!/bin/bash
# stand-in for a launcher: its arguments and the environment it matters for, as JSON
exec python3 -c 'import json, os, sys
keep = ("SLURM_NODEID", "SWIFTFUSION_TOPOLOGY", "NNODES", "GPUS_PER_NODE", "HEAD", "PORT")
print(json.dumps({"argv": sys.argv[1:], "env": {k: os.environ.get(k) for k in keep}}))' "$@"
"""


def _bin(tmp_path: Path, **fakes: str) -> Path:
    d = tmp_path / "bin"
    d.mkdir(exist_ok=True)
    for name, text in {"srun": SRUN, "scontrol": SCONTROL, **fakes}.items():
        (d / name).write_text(text)
        (d / name).chmod(0o755)
    return d


def _job(tmp_path: Path, script: str, *args: str, nodes: int = 2, gpus: int = 2,
         fakes: dict | None = None, timeout: int = 60, **env: str):
    """Run ``script`` as Slurm would in a job of ``nodes`` machines; (result, per-node output)."""
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    path = f"{_bin(tmp_path, **(fakes or {}))}:{Path(sys.executable).parent}:{os.environ['PATH']}"
    run_env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "NCCL_",
                                                                          "NVSHMEM_"))}
    run_env.update(PATH=path, SRUN_OUT=str(out), SLURM_JOB_NUM_NODES=str(nodes),
                   SLURM_JOB_ID="4242", GPUS_PER_NODE=str(gpus), PORT=str(free_port()),
                   SF_SLURM_DIR=str(SLURM), **env)
    proc = subprocess.Popen(["bash", str(SLURM / script), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=run_env, cwd=tmp_path,
                            start_new_session=True)  # its own process group: killed whole
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"{script} did not finish in {timeout} s; per machine: " + " | ".join(
            p.read_text()[-1500:] for p in sorted(out.glob("node*.out"))))
    res = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    return res, [(out / f"node{i}.out").read_text() for i in range(nodes)
                 if (out / f"node{i}.out").exists()]


def test_the_recipes_exist_and_parse():
    names = {p.name for p in SCRIPTS}
    assert {"check.sbatch", "compare.sbatch", "torchrun.sbatch", "xdit.sbatch"} <= names
    for script in [*SCRIPTS, SLURM / "env.sh"]:
        res = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert res.returncode == 0, f"{script.name}: {res.stderr}"
        if script.suffix == ".sbatch":
            text = script.read_text()
            assert "#SBATCH --ntasks-per-node=1" in text, script.name  # one launcher per machine
            assert "set -euo pipefail" in text and "env.sh" in text, script.name


def _env_of(tmp_path: Path, **env: str) -> dict:
    code = f'source {shlex.quote(str(SLURM / "env.sh"))} >/dev/null 2>&1; env'
    run_env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "NCCL_",
                                                                          "NVSHMEM_", "FABRIC"))}
    run_env.update(PATH=f"{_bin(tmp_path)}:{os.environ['PATH']}", SLURM_JOB_NUM_NODES="4",
                   SLURM_GPUS_ON_NODE="8", **env)
    res = subprocess.run(["bash", "-c", code], capture_output=True, text=True, env=run_env)
    assert res.returncode == 0, res.stderr
    return dict(line.split("=", 1) for line in res.stdout.splitlines() if "=" in line)


@pytest.mark.parametrize("fabric", ["efa", "ib", "socket"])
def test_env_sets_topology_and_the_network_for_each_fabric(tmp_path, fabric):
    env = _env_of(tmp_path, FABRIC=fabric)
    assert env["SWIFTFUSION_TOPOLOGY"] == "4x8" and Topology.parse(env["SWIFTFUSION_TOPOLOGY"])
    assert env["HEAD"] == "127.0.0.1" and env["NNODES"] == "4" and env["GPUS_PER_NODE"] == "8"
    if fabric == "efa":
        assert env["NVSHMEM_REMOTE_TRANSPORT"] == "libfabric"
        assert env["NVSHMEM_LIBFABRIC_PROVIDER"] == "efa"
        assert env["NCCL_NET"] == "AWS Libfabric"
    elif fabric == "ib":
        assert env["NVSHMEM_REMOTE_TRANSPORT"] == "ibrc" and "NCCL_NET" not in env
    else:
        assert "NVSHMEM_REMOTE_TRANSPORT" not in env and "NCCL_NET" not in env
    # what the user set wins
    assert _env_of(tmp_path, FABRIC=fabric, SWIFTFUSION_TOPOLOGY="2x16",
                   NVSHMEM_REMOTE_TRANSPORT="ucx")["SWIFTFUSION_TOPOLOGY"] == "2x16"


def test_env_refuses_an_unknown_fabric(tmp_path):
    res = subprocess.run(["bash", "-c", f'source {shlex.quote(str(SLURM / "env.sh"))}'],
                         capture_output=True, text=True,
                         env={**os.environ, "PATH": f"{_bin(tmp_path)}:{os.environ['PATH']}",
                              "FABRIC": "myrinet"})
    assert res.returncode == 2 and "FABRIC must be efa, ib or socket" in res.stderr


def test_check_job_runs_across_two_machines_on_cpu(tmp_path):
    """check.sbatch as Slurm runs it, 2 machines x 2 GPUs: torchrun's c10d rendezvous numbers
    the ranks node-major and the check, with the topology left to detection, finds 2 machines
    (torus degree 2) and passes every strategy."""
    res, nodes = _job(tmp_path, "check.sbatch", "--dtype", "fp32", "--heads", "4", "--seq-len",
                      "64", "--head-dim", "16", "--strategies", "tas,torus,swiftfusion",
                      timeout=240, SWIFTFUSION_TOPOLOGY="", FABRIC="socket")
    assert res.returncode == 0, res.stderr + "\n".join(nodes)
    assert "2 machines x 2 GPUs (topology detected)" in res.stdout
    table = nodes[0]
    for strategy in ("tas", "torus", "swiftfusion"):
        row = next(line for line in table.splitlines() if line.startswith(strategy + " "))
        assert "torus 2 x intra-Ulysses 2" in row and row.rstrip().endswith("PASS"), table


def _recorded(nodes: list[str]) -> list[dict]:
    return [json.loads(n.strip().splitlines()[-1]) for n in nodes]


def test_torchrun_job_line(tmp_path):
    """torchrun.sbatch: one torchrun per machine, c10d rendezvous on the first machine, every
    GPU a rank, the strategy passed to xFuser's runner (torchrun recorded, not run)."""
    res, nodes = _job(tmp_path, "torchrun.sbatch", "--model", "FLUX.1-dev", "--prompt", "a cat",
                      nodes=4, gpus=8, fakes={"torchrun": RECORD}, STRATEGY="torus",
                      FABRIC="efa")
    assert res.returncode == 0, res.stderr
    calls = _recorded(nodes)
    assert len(calls) == 4 and all(c["argv"] == calls[0]["argv"] for c in calls)
    argv, env = calls[0]["argv"], calls[0]["env"]
    assert argv[:5] == ["--nnodes=4", "--nproc-per-node=8", "--rdzv-backend=c10d",
                        f"--rdzv-endpoint=127.0.0.1:{env['PORT']}", "--rdzv-id=4242"]
    assert argv[5:] == ["-m", "xfuser.runner", "--sp-strategy", "torus", "--model", "FLUX.1-dev",
                        "--prompt", "a cat"]
    assert Topology.parse(env["SWIFTFUSION_TOPOLOGY"]) == Topology(4, 8)


def test_xdit_job_line(tmp_path):
    """xdit.sbatch: one xdit per machine with its own --node_rank (SLURM_NODEID), the first
    machine as master; xdit derives 8 processes per machine from --topology, as it does on a
    cluster (our xdit_nproc, the function xdit calls)."""
    res, nodes = _job(tmp_path, "xdit.sbatch", "--model", "FLUX.1-dev", "--prompt", "a cat",
                      nodes=4, gpus=8, fakes={"xdit": RECORD}, FABRIC="ib")
    assert res.returncode == 0, res.stderr
    calls = _recorded(nodes)
    assert [c["env"]["SLURM_NODEID"] for c in calls] == ["0", "1", "2", "3"]
    for i, call in enumerate(calls):
        argv, env = call["argv"], call["env"]
        flags = dict(zip(argv[0:12:2], argv[1:12:2]))
        assert flags == {"--nnodes": "4", "--node_rank": str(i), "--master_addr": "127.0.0.1",
                         "--master_port": env["PORT"], "--topology": "4x8",
                         "--sp-strategy": "swiftfusion"}
        assert argv[12:] == ["--model", "FLUX.1-dev", "--prompt", "a cat"]
        assert xdit_nproc(argv, 1) == 8
