"""The benchmark scripts run end to end (tiny sizes) and write well-formed JSON.

Only the shape of the output is checked here: timings on a shared CI machine prove
nothing. The real figures live in the README and bench/results/ with their commands.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _run(script: str, tmp_path: Path, *extra: str) -> dict:
    out = tmp_path / "out.json"
    subprocess.run([sys.executable, str(REPO / "bench" / script), "--quick", "--json", str(out), *extra],
                   check=True, cwd=REPO, timeout=600)
    return json.loads(out.read_text())


@pytest.mark.timeout(600)
def test_bench_layers_quick(tmp_path):
    result = _run("layers.py", tmp_path)
    assert set(result["ratios"]) == {"cbn_vs_batchnorm2d", "popnorm_vs_batchnorm2d", "syncbn_vs_batchnorm2d", "naive_vs_cbn"}
    assert all(isinstance(v, float) and v > 0 for v in result["ratios"].values())
    counts = result["collectives_2_ranks"]["per_layer_per_step"]
    assert {name: (c["forward"], c["backward"]) for name, c in counts.items()} == {
        "cbn": (1, 1), "popnorm": (1, 1), "syncbn": (1, 1)}
    assert result["machine"]["torch"]


@pytest.mark.timeout(600)
def test_bench_bnp_quick(tmp_path):
    result = _run("bnp.py", tmp_path)
    assert {"step_bnp_vs_plain", "mem_bnp_vs_plain"} <= set(result["ratios"])
    assert all(v > 0 for v in result["ratios"].values())
    assert result["models"]["resnet18"]["bnp_layers"] == 21
    assert result["models"]["resnet20"]["bnp_layers"] == 20
    assert "step_bnp_vs_plain_resnet20" in result["ratios"]


@pytest.mark.timeout(600)
def test_bench_data_quick(tmp_path):
    result = _run("data.py", tmp_path)
    assert set(result["ratios"]) == {"wds_vs_imagefolder_1worker", "wds_vs_imagefolder_2workers"}
    assert all(v > 0 for v in result["ratios"].values())
    assert result["images_per_pass"]["wds_1"] == result["images_per_pass"]["imagefolder_1"]
