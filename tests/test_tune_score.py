"""benchmarks/tune_score.py's options: well formed, and each head-block launch (fewer
heads per program than the launcher's) gives the launcher's profiles and mass sums,
here under the Triton interpreter (the GPU sweep times them; this checks what they
compute)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from kernels.score import score_layers
from kernels.targets import INTERPRETER
from tests.benchmark_scripts import load

tune = load("tune_score")


def test_the_families_and_their_labels():
    blocks, heads, every = (tune.options(f) for f in ("blocks", "heads", "all"))
    for family in (blocks, heads, every):
        assert family[0] == {}  # the launcher's own choice, timed first
        labels = [tune.label(o) for o in family]
        assert len(set(labels)) == len(labels), labels
    assert not any("heads" in o for o in blocks)
    assert {o["heads"] for o in heads[1:]} == {1, 2, 4}
    assert every == blocks + heads[1:]
    with pytest.raises(ValueError, match="family"):
        tune.options("rows")


@pytest.mark.parametrize("heads", [1, 2, 4])
def test_a_head_block_launch_scores_as_the_launcher(heads):
    """r = 6: 1, 2 and 4 heads a program (two padding heads) score as the launcher."""
    gen = torch.Generator().manual_seed(heads)
    q = torch.randn(2, 12, 20, 32, generator=gen)
    k = torch.randn(2, 2, 150, 32, generator=gen)
    opt = {"BLOCK_N": 64, "num_warps": 4, "stages": (2, 2), "heads": heads}
    launch = tune.launch_for(opt, q, k, target=INTERPRETER)
    assert (launch.R_BLK, launch.n_rb) == (heads, -(-6 // heads))  # blocks covering r
    assert (launch.W_BLK, launch.n_qb) == (32, 1)  # the whole window in each program
    prof, sums = score_layers(q, k, 4, launch=launch)
    ref_prof, ref_sums = score_layers(q, k, 4)
    torch.testing.assert_close(prof, ref_prof, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(sums, ref_sums, rtol=1e-5, atol=1e-7)
    assert torch.allclose(prof.sum(-1), torch.ones(2, 12))  # each head's profile sums to 1


def test_programs_per_sm_by_hand():
    """sm_90 occupancy by hand: 255 registers x 256 threads gives 1; 95 x 128 gives 5 (registers
    bind before shared memory and warps)."""
    from kernels.aot import programs_per_sm
    from kernels.targets import cuda_target

    sm90 = cuda_target(90)
    assert programs_per_sm({"registers": 255, "shared": 217_088}, 8, sm90) == 1
    assert programs_per_sm({"registers": 95, "shared": 24_832}, 4, sm90) == 5
    assert programs_per_sm({"registers": 32, "shared": 114_688}, 4, sm90) == 2  # by shared
    assert programs_per_sm({"registers": 16, "shared": 0}, 8, sm90) == 8  # by warps


def test_resources_compiles_for_sm90_without_a_gpu(tmp_path):
    """`tune_score.py --resources` compiles for sm_90 without a GPU: no spills."""
    from tests.test_kernel_compile import ROOT, _compiled_env

    out = tmp_path / "resources.json"
    proc = subprocess.run(
        [sys.executable, "benchmarks/tune_score.py", "--resources", "--limit", "1",
         "--out", str(out)],
        cwd=ROOT, env=_compiled_env(), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-2000:]
    report = json.loads(out.read_text())
    assert report["arch"] == 90
    (row,) = report["rows"]
    assert row["option"] == "launcher" and row["rows"] == 256 and row["R_BLK"] == 8
    for kernel in ("stats", "profile"):
        usage = row[kernel]
        assert 0 < usage["registers"] <= 255 and 0 < usage["shared"] <= 232_448, usage
        assert usage["programs_per_sm"] >= 1, usage
        # Nothing spilled to local memory.
        assert usage["stack"] == 0, usage
    # Refused where the kernels would be defined interpreted.
    proc = subprocess.run(
        [sys.executable, "benchmarks/tune_score.py", "--resources", "--limit", "1"],
        cwd=ROOT, env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert proc.returncode == 2 and "TRITON_INTERPRET" in proc.stdout, proc.stdout
