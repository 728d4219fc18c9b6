"""``swiftfusion compare --engine sglang``: SGLang's Flux model class under SGLang's USP splits and
our strategies. The default run's end-to-end case rides the SGLang child of
``test_sglang_attention.py`` (one SGLang import: ``compare_jobs`` there, ``check_fast`` here);
the row selection runs here without SGLang; heavier cases are ``slow``."""
from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path

import pytest

from support import sglang_env
from xfuser_swiftfusion.tools import compare_sglang as cs
from xfuser_swiftfusion.tools.compare import CompareArgumentError

FAST = ["compare", "--engine", "sglang", "--emulate", "2x2", "--height", "64", "--width", "64",
        "--max-sequence-length", "16", "--steps", "2", "--repeats", "1",
        "--strategies", "sglang,swiftfusion"]
ERRORS = [(["--model", "tiny-wan"], "--engine sglang runs tiny-flux"),
          (["--height", "40"], "must be multiples of 16"),
          (["--height", "48", "--width", "48"], "9 image tokens, not divisible by the 4 ranks"),
          (["--strategies", "sglang:U3xR1"], "unknown or invalid row 'sglang:U3xR1'"),
          (["--steps", "1"], "--steps must be >= 2")]


def cli(argv: list[str]) -> tuple[int, str, str, list | None]:
    """``swiftfusion <argv> --json``: (exit code, stdout, stderr, the JSON rows or None)."""
    from xfuser_swiftfusion.tools.cli import main
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "rows.json")
        # files, not StringIO: SGLang's group setup redirects sys.stdout's file descriptor
        with open(os.path.join(tmp, "out"), "w+") as out, open(os.path.join(tmp, "err"), "w+") as err:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                rc = main([*argv, "--json", path])
            out.seek(0)
            err.seek(0)
            text = out.read(), err.read()
        rows = json.loads(Path(path).read_text()) if os.path.exists(path) else None
    return rc, *text, rows


def hidden_signature() -> str:
    """What the hook says when ``USPAttention.forward`` reads through a wrapper that hides
    SGLang's arguments (no ``__wrapped__``): a mask it cannot see would run on our strategy."""
    from xfuser_swiftfusion.integrations.sglang import hooks
    saved = list(hooks._signature)
    hooks._signature.clear()
    try:
        hooks._forward_signature(lambda self, q, k, v, *args, **kwargs: None)
        return "no error"
    except RuntimeError as exc:
        return str(exc)
    finally:
        hooks._signature[:] = saved


def compare_jobs() -> dict:
    """In a process that imports SGLang: the fast case, the argument errors, the hook's guard."""
    base = ["compare", "--engine", "sglang", "--emulate", "2x2"]
    return {"fast": cli(FAST), "errors": [cli(base + argv)[:3] for argv, _ in ERRORS],
            "hidden": hidden_signature()}


def check_fast(result: dict) -> None:
    rc, table, err, rows = result["fast"]
    assert rc == 0, table + err
    assert [r["strategy"] for r in rows] == ["sglang:U4xR1", "swiftfusion"], rows
    # 8 heads x 64 fp32; 16 image + 16 text tokens sharded: 8 rows per rank; 2 attention layers.
    # Ulysses over 4 ranks on 2 machines: each of Q, K, V, O sends 2 of its 4 head slices across.
    per_layer = 4 * 2 * (8 * 8 * 64 * 4) // 4
    for r in rows:
        assert r["passed"] is True and 0 <= r["max_abs_err"] <= 1e-4, r
        assert r["mesh"] == "2x1x2", r
        assert r["inter_node_bytes_per_gpu"] == 2 * per_layer, r
        assert r["step_latency_s"] > r["attention_latency_s"] > 0, r
        assert r["peak_memory_bytes"] > 10 * 2**20 and r["compute_only_s"] > 0, r
        assert r["link_s"] is None, r  # no --link-mbit: no line rate to price the bytes at
    assert rows[0]["fallbacks"] is None and rows[1]["fallbacks"] == {}, rows
    assert rows[1]["engine"] == "swiftfusion" and rows[0]["engine"] == "sglang"
    lines = table.splitlines()
    skipped = [line for line in lines if line.startswith("skipped")]
    assert len(skipped) == 1 and "sglang:U2xR2, sglang:U1xR4" in skipped[0], table
    assert "softmax LSE" in skipped[0], table
    assert any(line.startswith("compute only") for line in lines), table
    assert "Warning" not in table + err
    for (argv, message), (rc, out, err) in zip(ERRORS, result["errors"]):
        assert rc == 2 and message in err, (argv, out, err)
    assert "hides SGLang's arguments" in result["hidden"], result["hidden"]


@pytest.mark.parametrize("world,splits", [
    (4, [(4, 1), (2, 2), (1, 4)]), (8, [(8, 1), (4, 2), (2, 4), (1, 8)]), (6, [(2, 3), (1, 6)])])
def test_sglang_splits_are_the_valid_ulysses_by_ring(world, splits):
    assert cs.sglang_splits(world) == splits  # 8 heads: Ulysses must divide them


def test_rows_expand_sglang_and_refuse_invalid_splits():
    rows, splits = cs.select("sglang,torus", 4)
    assert rows == ["sglang:U4xR1", "sglang:U2xR2", "sglang:U1xR4", "torus"]
    assert splits == [(4, 1), (2, 2), (1, 4)]
    assert cs.select(None, 2)[0] == ["sglang:U2xR1", "sglang:U1xR2", *cs.OURS]
    for bad in ("sglang:U3xR2", "usp", "sglang:U2xR1"):  # U2xR1 is not 4 ranks
        with pytest.raises(CompareArgumentError, match="unknown or invalid row"):
            cs.select(bad, 4)


_absent = sglang_env.absent()


@pytest.mark.slow
@pytest.mark.skipif(_absent is not None, reason=_absent or "")
def test_slow_link_all_rows_limit_and_tail_padded_text_fallbacks(sglang_child):
    """At 80 Mbit/s (root: network namespaces) every row with its limit; 13 text tokens on 4
    ranks are tail-padded by SGLang, so our strategies leave those calls to SGLang, counted
    (the compare's timing wrapper around ``USPAttention.forward`` once hid that mask from the
    hook: the strategies ran it and were off by 0.1)."""
    argv = ["compare", "--engine", "sglang", "--emulate", "2x2", "--link-mbit", "80",
            "--height", "128", "--width", "128", "--max-sequence-length", "13", "--steps", "2",
            "--repeats", "1"]
    ((rc, table, err, rows),) = sglang_child.run([(Path(__file__).stem, "cli", (argv,))])
    assert rc == 0, table + err
    assert [r["strategy"] for r in rows] == ["sglang:U4xR1", *cs.OURS], table
    for r in rows:
        assert r["passed"] is True, r
        # a machine's bytes (2 GPUs) at 10 MB/s
        assert r["link_s"] == pytest.approx(r["inter_node_bytes_per_gpu"] * 2 / 1e7), r
    assert all(sum(r["fallbacks"].values()) > 0 for r in rows[1:]), rows
    assert "attention mask metadata" in table and "fwd/limit" in table
