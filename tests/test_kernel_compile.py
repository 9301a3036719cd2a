"""Every Triton kernel compiles at every launch configuration its launcher chooses for sm_80 and
sm_90 and fits their shared memory, with no GPU (`kernels/aot.py`, in a subprocess whose kernels
are compiled, not interpreted). Negative controls: a kernel reading a module global and an
oversized fp32-dot launch must be refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _compiled_env() -> dict:
    """This environment without TRITON_INTERPRET: the child compiles the kernels."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


def test_every_launch_compiles_and_fits_sm80_and_sm90(tmp_path):
    out = tmp_path / "aot.json"
    proc = subprocess.run(
        [sys.executable, "-m", "pagekv.kernels.aot", "--arch", "80", "90", "--jobs",
         str(max(1, min(os.cpu_count() or 1, 4))), "--json", str(out)],
        cwd=ROOT, env=_compiled_env(), capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    tail = (proc.stdout + proc.stderr)[-3000:]
    report = json.loads(out.read_text())
    failed = [f"{r['target']} {r['label']}: {r['error']}" for r in report["results"] if not r["ok"]]
    assert not failed, "\n".join(failed[:10])
    assert proc.returncode == 0, tail
    results = report["results"]
    assert report["targets"] == ["sm_80", "sm_90"]
    limits = {"sm_80": 166_912, "sm_90": 232_448}
    for r in results:
        assert r["limit"] == limits[r["target"]], r
        assert 0 <= r["shared"] <= r["limit"], r
    # Every kernel, on both targets; the scoring kernels at the pilot model's launch
    # (r = 6 -> 8 heads per block, the default window of 32, head dim 128, bf16) and with
    # the fp32 dot (fp32 and mixed inputs).
    kernels = {"_stats_kernel", "_profile_kernel", "_pool_pages_kernel",
               "_gather_layers_kernel", "_paged_decode_kernel"}  # fmt: skip
    for target in limits:
        labels = [r["label"] for r in results if r["target"] == target]
        assert {label.split("[")[0] for label in labels} == kernels, target
        pilot = "R_BLK=8, W_BLK=32, D_PAD=128, BLOCK_N=64, DOT_FP32=False, K_ELEM=bf16"
        assert any(pilot in label for label in labels), target
        assert any("DOT_FP32=True" in label and "K_ELEM=bf16" in label for label in labels)


def test_the_grid_spans_the_bundled_models_shapes():
    """The grid holds the bundled models' (head dim, r) and a window of one token."""
    from pagekv.kernels.aot import GRID

    assert {(128, 6), (64, 3), (64, 7)} <= set(GRID.shapes())  # pilot, bundled, second
    assert min(GRID.windows) == 1
    assert set(GRID.dtypes) == {
        (torch.float32, torch.float32),
        (torch.float16, torch.float16),
        (torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.bfloat16),
    }


def test_launchers_fit_blocks_to_the_target_dtype_and_head_dim():
    """Blocks follow the target's shared memory, dtype and head dim; what cannot fit is refused."""
    from pagekv.kernels.score import _shared_estimate, score_launch
    from pagekv.kernels.targets import INTERPRETER, cuda_target

    bf16, fp32 = torch.bfloat16, torch.float32
    sm90, sm86 = cuda_target(90), cuda_target(86)
    assert sm86.shared_bytes < sm90.shared_bytes
    big90 = score_launch(sm90, bf16, bf16, 256, 8, 32)
    big86 = score_launch(sm86, bf16, bf16, 256, 8, 32)
    assert big86.rows < big90.rows, (big90, big86)
    for t, cfg in ((sm90, big90), (sm86, big86)):
        est = _shared_estimate(cfg.rows, cfg.BLOCK_N, cfg.D_PAD, 2, max(cfg.stages))
        assert est <= t.shared_bytes, (t, cfg, est)
    half = score_launch(sm90, bf16, bf16, 128, 6, 32)
    mixed = score_launch(sm90, fp32, bf16, 128, 6, 32)
    assert not half.DOT_FP32 and mixed.DOT_FP32
    assert mixed.rows * mixed.BLOCK_N < half.rows * half.BLOCK_N, (half, mixed)
    assert score_launch(INTERPRETER, bf16, bf16, 128, 6, 32).BLOCK_N >= half.BLOCK_N
    with pytest.raises(ValueError, match="no scoring block fits"):
        score_launch(sm86, bf16, bf16, 4096, 8, 32)


def test_an_interpreted_kernel_is_reported_not_compiled():
    """In this process the kernels are defined interpreted (tests/conftest.py): the check
    reports that, without trying a compile, and `compile_for` refuses it."""
    from pagekv.kernels.aot import Interpreted, compile_for, compile_launch, launches
    from pagekv.kernels.targets import cuda_target

    sm90 = cuda_target(90)
    launch = launches(sm90)[0]
    got = compile_launch(launch, sm90)
    assert got == {"label": launch.label, "target": sm90.name, "limit": sm90.shared_bytes,
                   "ok": False, "error": "kernels defined under TRITON_INTERPRET=1"}  # fmt: skip
    with pytest.raises(Interpreted, match="TRITON_INTERPRET=1"):
        compile_for(launch, sm90)


PLANTED = """
import triton
import triton.language as tl

NEG = -1.0e30  # a plain module global, as NEG_BIG was


@triton.jit
def reads_a_global(x_ptr, BLOCK: tl.constexpr):
    o = tl.arange(0, BLOCK)
    tl.store(x_ptr + o, tl.full([BLOCK], NEG, tl.float32))
"""

CONTROLS = """
import json, sys
sys.path.insert(0, sys.argv[1])
from pagekv.kernels._common import Launch
from pagekv.kernels.aot import compile_launch
from pagekv.kernels.targets import cuda_target

planted = Launch(module="planted", kernel="reads_a_global", types=(("x_ptr", "*fp32"),),
                 constexprs=(("BLOCK", 64),))
# The runner's launch before this check: fp32 window queries over the bf16 cache took
# the fp32 dot at 8 heads x 32 queries of head dim 128 with Triton's default 3 stages.
import triton.language as tl
before = Launch(module="pagekv.kernels.score", kernel="_profile_kernel",
                types=(("q_ptr", "*fp32"), ("ktab_ptr", "*i64"), ("scale_ptr", "*fp32"),
                       ("lse_ptr", "*fp32"), ("prof_ptr", "*fp32"), ("top_ptr", "*fp32"),
                       ("part_ptr", "*fp32")),
                constexprs=(("R_BLK", 8), ("W_BLK", 32), ("D_PAD", 128), ("BLOCK_N", 64),
                            ("DOT_FP32", True), ("K_ELEM", tl.bfloat16)),
                num_warps=8, num_stages=3)
out = [compile_launch(planted, cuda_target(90)), compile_launch(before, cuda_target(90))]
print(json.dumps(out))
"""


def test_the_check_refuses_a_global_read_and_an_oversized_launch(tmp_path):
    (tmp_path / "planted.py").write_text(PLANTED)
    proc = subprocess.run(
        [sys.executable, "-c", CONTROLS, str(tmp_path)],
        cwd=ROOT, env=_compiled_env(), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    planted, before = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not planted["ok"] and "does not compile" in planted["error"], planted
    assert "global" in planted["error"].lower(), planted
    assert not before["ok"] and before["shared"] > 232_448, before
    assert "shared memory" in before["error"], before
