"""``swiftfusion compare-diffusers`` end to end on an emulated 2x2 cluster, its volume model
and its choice of diffusers configurations."""
from __future__ import annotations

import json

import pytest

import xfuser_swiftfusion  # noqa: F401
from xfuser_swiftfusion.tools.cli import main
from xfuser_swiftfusion.tools.compare import JSON_FIELDS
from xfuser_swiftfusion.tools.compare_diffusers import (OURS, PREFIX, diffusers_degrees,
                                                        diffusers_mesh_label,
                                                        modelled_diffusers_bytes, select)
from xfuser_swiftfusion.topology import Topology


pytestmark = pytest.mark.usefixtures("tiny_checkpoint_cache")


def test_compare_diffusers_tiny_flux(tmp_path, capsys):
    out_json, out_png = tmp_path / "c.json", tmp_path / "c.png"
    rc = main(["compare-diffusers", "--model", "tiny-flux", "--emulate", "2x2", "--steps", "2",
               "--repeats", "1", "--json", str(out_json), "--plot", str(out_png)])
    table = capsys.readouterr().out
    assert rc == 0, table
    rows = json.loads(out_json.read_text())
    names = [r["strategy"] for r in rows]
    assert any(n.startswith(PREFIX) for n in names), names
    assert set(OURS) <= set(names), names
    for r in rows:
        assert set(JSON_FIELDS) | {"engine"} == set(r)
        assert r["passed"] is True and 0 <= r["max_abs_err"] <= 1e-4, r
        assert r["step_latency_s"] > r["attention_latency_s"] > 0
        assert r["peak_memory_bytes"] > 10 * 2**20
    by_name = {r["strategy"]: r for r in rows}
    # the volume model of diffusers' 4-way Ulysses equals the bytes our communicator counts
    # for the same mesh (tas: 2 per machine x 2 machines)
    ulysses = by_name[PREFIX + "ulysses"]
    assert ulysses["mesh"] == by_name["tas"]["mesh"] == "2x1x2"
    assert ulysses["inter_node_bytes_per_gpu"] == by_name["tas"]["inter_node_bytes_per_gpu"] > 0
    assert "PASS" in table and "FAIL" not in table
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_degrees_and_mesh_labels():
    topo = Topology(2, 2)
    assert diffusers_degrees("ulysses", topo, 24) == (1, 4)
    assert diffusers_degrees("ulysses", Topology(5, 1), 24) is None
    assert diffusers_degrees("ring", topo, 24, cuda=True) == (4, 1)
    assert diffusers_degrees("unified", topo, 24, cuda=True) == (2, 2)
    assert diffusers_degrees("unified", Topology(1, 4), 24, cuda=True) is None
    assert diffusers_degrees("ring", topo, 24, cuda=False) is None
    assert diffusers_mesh_label(topo, 1, 4) == "2x1x2"
    assert diffusers_mesh_label(topo, 4, 1) == "1x4x1"
    assert diffusers_mesh_label(topo, 2, 2) == "2x2x1"


def test_modelled_diffusers_bytes():
    topo, call = Topology(2, 2), [(1, 10, 24, 8, 4)]   # B, S_local, H, D, fp32
    n = 1 * 10 * 24 * 8 * 4
    assert modelled_diffusers_bytes(topo, 1, 4, call, 0) == 4 * 2 * n // 4  # 2 peers off-machine
    assert modelled_diffusers_bytes(topo, 4, 1, call, 0) == 2 * 2 * n       # K, V to 2 peers
    assert modelled_diffusers_bytes(topo, 2, 2, call, 0) == 2 * 1 * n       # Ulysses intra
    assert modelled_diffusers_bytes(Topology(1, 4), 1, 4, call, 0) == 0


def test_select_rows_and_errors():
    rows, skipped = select(None, Topology(5, 1), 24)
    assert rows == list(OURS) and PREFIX + "ulysses" not in rows and "ulysses" in skipped
    with pytest.raises(ValueError, match="unknown configuration warp"):
        select("ulysses,warp", Topology(2, 2), 24)
    with pytest.raises(ValueError, match="cannot run"):
        select("diffusers:ulysses", Topology(5, 1), 24)
