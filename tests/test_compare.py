"""``swiftfusion compare`` end to end on an emulated cluster, its JSON/plot, argument errors."""
from __future__ import annotations

import json

import pytest

import xfuser_swiftfusion  # noqa: F401
from xfuser_swiftfusion.tools.cli import main
from xfuser_swiftfusion.tools.compare import JSON_FIELDS, modelled_usp_bytes
from xfuser_swiftfusion.mesh import choose_mesh
from xfuser_swiftfusion.topology import Topology

FIELDS = {"strategy", "mesh", "step_latency_s", "attention_latency_s",
          "inter_node_bytes_per_gpu", "peak_memory_bytes", "max_abs_err", "passed"}


pytestmark = pytest.mark.usefixtures("tiny_checkpoint_cache")


def test_compare_tiny_flux_json_and_plot(tmp_path, capsys):
    out_json, out_png = tmp_path / "c.json", tmp_path / "c.png"
    rc = main(["compare", "--model", "tiny-flux", "--emulate", "2x2", "--strategies",
               "usp,swiftfusion", "--steps", "2", "--repeats", "1",
               "--json", str(out_json), "--plot", str(out_png)])
    table = capsys.readouterr().out
    assert rc == 0, table
    rows = json.loads(out_json.read_text())
    assert [r["strategy"] for r in rows] == ["usp", "swiftfusion"]
    for r in rows:
        assert set(r) == FIELDS and tuple(r) == JSON_FIELDS
        assert r["passed"] is True and 0 <= r["max_abs_err"] <= 1e-4
        assert r["mesh"] == "2x1x2"          # U=2 per machine x R=1 x T=2 machines
        assert r["step_latency_s"] > r["attention_latency_s"] > 0
        assert r["peak_memory_bytes"] > 10 * 2**20
    # 24 heads, 16 x 16 head dim, 144 image tokens / 4 ranks, fp32, 4 attention layers / step:
    # each rank sends 2 of 4 Ulysses slices off-machine in each of 4 all-to-alls (Q, K, V, O)
    per_layer = 4 * (36 * 24 * 16 * 4 // 4) * 2
    assert rows[0]["inter_node_bytes_per_gpu"] == 4 * per_layer
    assert rows[1]["inter_node_bytes_per_gpu"] >= 4 * per_layer  # counted by the communicator
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "swiftfusion" in table and "PASS" in table


def test_compare_tiny_wan_through_xfusers_wan_wrapper(tmp_path, capsys):
    """tiny-wan: xFuser's own Wan wrapper under every strategy equals plain diffusers."""
    out_json = tmp_path / "w.json"
    rc = main(["compare", "--model", "tiny-wan", "--emulate", "2x2", "--strategies",
               "usp,tas,swiftfusion", "--steps", "2", "--repeats", "1", "--json", str(out_json)])
    table = capsys.readouterr().out
    assert rc == 0, table
    rows = json.loads(out_json.read_text())
    assert [r["strategy"] for r in rows] == ["usp", "tas", "swiftfusion"]
    for r in rows:
        assert r["passed"] is True and 0 <= r["max_abs_err"] <= 1e-4, r
        assert r["mesh"] == "2x1x2", r       # 24 heads on 2x2: U=2 per machine x R=1 x T=2
        # the strategy ran the attention: the same inter-machine bytes for each (U4 all-to-alls)
        assert r["attention_latency_s"] > 0 and r["inter_node_bytes_per_gpu"] > 0, r
    assert len({r["inter_node_bytes_per_gpu"] for r in rows}) == 1, rows
    assert "tiny-wan (wan) 64x64x9f" in table


def test_modelled_usp_bytes_counts_offmachine_slices():
    mesh = choose_mesh(Topology(2, 2), 24, "usp")
    # one call: B=1, H=24, S_local=10, D=8, fp32 -> X = 1920 elements per tensor per rank
    assert modelled_usp_bytes(mesh, [(1, 24, 10, 8, 4)], rank=0) == 4 * (1920 // 4) * 2 * 4
    assert modelled_usp_bytes(choose_mesh(Topology(1, 4), 24, "usp"), [(1, 24, 10, 8, 4)], 0) == 0


@pytest.mark.parametrize("argv,message", [
    (["--emulate", "2x2", "--strategies", "usp,warp"], "unknown strategy warp"),
    (["--emulate", "5x1"], "144 image tokens, not divisible by the 5 ranks"),
    (["--emulate", "2x2", "--height", "42"], "must be multiples of 4"),
    (["--model", "tiny-cogvideox", "--emulate", "2x4", "--height", "96"],
     "the height must be a multiple of 64"),
    (["--emulate", "2x2", "--model", "/nonexistent/ckpt"], "not a local diffusers checkpoint"),
    (["--model", "tiny-wan", "--emulate", "5x1"], "48 video tokens, not divisible by the 5 ranks"),
    (["--model", "tiny-wan", "--emulate", "2x2", "--num-frames", "8"],
     "--num_frames must be 1 + a multiple of 4"),
    (["--emulate", "2x2", "--steps", "1"], "--steps must be >= 2"),
    ([], "not launched by torchrun"),
])
def test_argument_errors_are_clear(argv, message, capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    rc = main(["compare", *argv])
    err = capsys.readouterr().err
    assert rc == 2 and message in err, err
