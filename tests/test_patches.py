"""The upstream-ready diffs under patches/ apply to pristine xfuser 0.7.0 and do what apply() does.

Pristine sources come from the installed wheel (no network): every file a patch touches is
checked against the wheel's RECORD hash first, then copied into a temporary tree where the
patch is dry-run (``patch -p1 --dry-run``, or ``git apply --check`` without ``patch``).
"""
from __future__ import annotations

import base64
import hashlib
import importlib.metadata as md
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PATCH_DIR = REPO / "patches"
PATCHES = sorted(PATCH_DIR.glob("*.patch"))


def _dist():
    return md.distribution("xfuser")


def _site_root() -> Path:
    return Path(_dist().locate_file(""))


def _record_hashes() -> dict[str, str]:
    hashes = {}
    for f in _dist().files or ():
        if f.hash is not None:
            hashes[str(f).replace(os.sep, "/")] = f.hash.value
    return hashes


def _patched_files(patch: Path) -> list[str]:
    files = []
    for line in patch.read_text().splitlines():
        m = re.match(r"^\+\+\+ b/(\S+)", line)
        if m:
            files.append(m.group(1))
    return files


def _sha256_b64(path: Path) -> str:
    digest = hashlib.sha256(path.read_bytes()).digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def test_patch_dir_has_patches_and_readme():
    assert PATCHES, "no *.patch files under patches/"
    readme = (PATCH_DIR / "README.md").read_text()
    for p in PATCHES:
        assert p.name in readme, f"{p.name} is not described in patches/README.md"
        for f in _patched_files(p):
            assert f in readme, f"{f} (patched by {p.name}) is not listed in patches/README.md"


def test_installed_xfuser_is_0_7_0():
    assert _dist().version == "0.7.0"


def _pristine_copy(patch: Path, dest: Path) -> None:
    root = _site_root()
    record = _record_hashes()
    for rel in _patched_files(patch):
        assert rel in record, f"{rel} is not in xfuser's RECORD"
        src = root / rel
        assert _sha256_b64(src) == record[rel], (
            f"installed {rel} differs from the xfuser 0.7.0 wheel (RECORD hash mismatch): "
            "site-packages was edited; reinstall xfuser==0.7.0")
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dest / rel)


@pytest.mark.parametrize("patch", PATCHES, ids=[p.name for p in PATCHES])
def test_patch_applies_to_pristine_sources(patch: Path, tmp_path: Path):
    _pristine_copy(patch, tmp_path)
    if shutil.which("patch"):
        cmd = ["patch", "-p1", "--dry-run", "--force", "-i", str(patch)]
    else:
        cmd = ["git", "apply", "--check", "-p1", str(patch)]
    res = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True)
    assert res.returncode == 0, f"{' '.join(cmd)} failed:\n{res.stdout}\n{res.stderr}"
    assert "FAILED" not in res.stdout and "fuzz" not in res.stdout.lower(), res.stdout


_EQUIVALENCE_SCRIPT = textwrap.dedent("""
    import sys, torch
    from xfuser_swiftfusion import xfuser_compat
    xfuser_compat.apply = lambda: None          # the source patch alone must suffice
    import xfuser, xfuser.envs as envs
    assert xfuser.__file__.startswith(sys.argv[1]), xfuser.__file__
    assert envs.get_torch_distributed_backend() == "gloo"
    assert envs.get_device_version() is None
    from xfuser.core.distributed import parallel_state
    assert parallel_state.HAS_LONG_CTX_ATTN
    from xfuser.model_executor.layers import usp
    assert usp.PROCESS_GROUP is not None
    from xfuser.core.distributed.attention_backend import (
        ATTENTION_FUNCTION_REGISTRY as REG, AttentionBackendType as T)
    q, k, v = (torch.randn(1, 2, 5, 8, dtype=torch.float64) for _ in range(3))
    out, lse = REG[T.SDPA_FLASH](q, k, v, dropout_p=0.0, is_causal=False)
    ref = torch.logsumexp(q @ k.transpose(-1, -2) / 8 ** 0.5, dim=-1)
    assert torch.allclose(lse.double(), ref, atol=1e-6), (lse, ref)
    from xfuser.core.distributed.runtime_state import RuntimeState
    assert RuntimeState._select_attention_backend(None, None) == T.SDPA_FLASH

    from xfuser_swiftfusion.launcher import run_emulated
    from xfuser_swiftfusion import xfuser_state as xs

    def ring_only():
        import torch.distributed as dist
        xs.init_xfuser_parallel(1, 2, "usp")
        try:
            torch.manual_seed(1)
            q, k, v = (torch.randn(1, 2, 12, 8) for _ in range(3))
            r = dist.get_rank()
            o = xs.xfuser_usp(*(t[:, :, r * 6:(r + 1) * 6].contiguous() for t in (q, k, v)))
            ref = torch.softmax(q.double() @ k.double().transpose(-1, -2) / 8 ** 0.5, -1) @ v.double()
            return (o.double() - ref[:, :, r * 6:(r + 1) * 6]).abs().max().item()
        finally:
            xs.destroy_xfuser_parallel()

    errs = run_emulated(ring_only, "1x2", timeout_s=120)
    assert max(errs) < 1e-5, errs
    print("EQUIVALENT", errs)
""")


def test_patched_sources_work_on_cpu_without_runtime_patches(tmp_path: Path):
    """Apply every patch to a copy of the installed xfuser and run USP's ring on CPU with it."""
    root = _site_root()
    shutil.copytree(root / "xfuser", tmp_path / "xfuser",
                    ignore=shutil.ignore_patterns("__pycache__"))
    for patch in PATCHES:
        _pristine_copy(patch, tmp_path)   # the files it touches, RECORD-verified
        cmd = (["patch", "-p1", "--force", "-i", str(patch)] if shutil.which("patch")
               else ["git", "apply", "-p1", str(patch)])
        res = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True)
        assert res.returncode == 0, res.stdout + res.stderr
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(REPO)]),
               PYTHONDONTWRITEBYTECODE="1")
    res = subprocess.run([sys.executable, "-c", _EQUIVALENCE_SCRIPT, str(tmp_path)],
                         capture_output=True, text=True, env=env, timeout=240)
    assert res.returncode == 0 and "EQUIVALENT" in res.stdout, res.stdout[-3000:] + res.stderr[-6000:]
