"""bench/scale.py: the synchronization-at-scale model is checked where it is exact -- the
layers and channels it counts, NCCL's latency formulas it transcribes, the shares it derives
and the committed JSON it wrote -- and its simulation is run once, briefly, for its counts and
schema. No time or ratio of times is held to a bound (tests/README.md): the model's error
against the simulated hosts is a measurement, committed in bench/results/scale-cpu.json.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RESULT = REPO / "bench" / "results" / "scale-cpu.json"


@pytest.fixture(scope="module")
def scale():
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import scale as module
    finally:
        sys.path.remove(str(REPO / "bench"))
    return module


def test_synced_layers_are_counted_from_the_models(scale):
    """53 BatchNorms in torchvision's ResNet-50, 49 in EfficientNet-B0, each synchronized."""
    resnet50, effnet = scale.synced_layers("resnet50"), scale.synced_layers("efficientnet_b0")
    assert (len(resnet50), sum(resnet50)) == (53, 26560)
    assert (len(effnet), sum(effnet)) == (49, 21008)
    # every collective a frame: 8 bytes x (3 x the widest layer + 2 x the group's ranks)
    assert scale.collective_bytes([64, 128], 4) == [8 * (3 * 128 + 2 * 4)] * 4


def test_nccl_latency_model_follows_tuning_cc(scale):
    """The transcription of NCCL's formulas: one node by ring (2 (p - 1) NVLink hops), many by
    tree (log2 of the nodes network hops each way), nothing for a group of one."""
    assert scale.nccl_allreduce_us(0, 1) == (0.0, "none")
    us, algo = scale.nccl_allreduce_us(0, 8)
    assert algo == "ring" and us == pytest.approx(6.6 + 14 * 0.6)
    us, algo = scale.nccl_allreduce_us(0, 1024)
    assert algo == "tree" and us == pytest.approx(6.8 + 2 * (7 * 0.6 + 7 * 5.0))
    # tree: each quadrupling of the nodes adds 2 x 2 network hops, whatever the scale
    steps = [scale.nccl_allreduce_us(0, w)[0] for w in (64, 256, 1024)]
    assert steps[1] - steps[0] == pytest.approx(steps[2] - steps[1]) == pytest.approx(2 * 2 * 5.0)
    # bytes cost over the LL bandwidth cap: 20.4 GB/s bus, half of it algorithm bandwidth (tree)
    assert scale.nccl_allreduce_us(10_200, 1024)[0] - us == pytest.approx(1.0)


def test_prediction_is_consistent(scale):
    """share = sync / (sync + compute); it grows with the group; the recipes' group is the
    largest one under the threshold and one that divides the world."""
    pred = scale.predict()
    for name, model in pred["models"].items():
        assert model["collectives_per_step"] == 2 * model["synced_layers"]
        for b, p in model["per_gpu_batch"].items():
            assert p["compute_ms"] == pytest.approx(b / model["images_per_s_assumed"] * 1e3, rel=1e-3)
            shares = [p["share_per_group"][g] for g in scale.GROUPS]
            assert shares[0] == 0 and shares == sorted(shares)
            for g in scale.GROUPS:
                sync = model["sync_ms_per_group"][g]
                assert p["share_per_group"][g] == pytest.approx(sync / (sync + p["compute_ms"]), abs=1e-4)
            for w, row in p["worlds"].items():
                best = row["largest_group_under_threshold"]
                assert w % best == 0 and (best == 1 or p["share_per_group"][best] < pred["threshold"])
                bigger = [g for g in row["share_per_group"] if g > best]
                assert all(row["share_per_group"][g] >= pred["threshold"] for g in bigger)
                assert row["share_full_sync"] == p["share_per_group"][w]


def test_committed_result_matches_the_model(scale):
    """bench/results/scale-cpu.json was written by this model (not an older one), on the
    simulated hosts, with its machine and date."""
    committed = json.loads(RESULT.read_text())
    assert committed["machine"]["date"] and committed["machine"]["cpu_count"]
    assert committed["prediction"] == json.loads(json.dumps(scale.predict()))
    measured = committed["measured"]
    assert measured["hosts"] == 2 and set(measured["links"]) >= {"none"}
    for link, by_world in measured["runs"].items():
        assert sorted(int(w) for w in by_world) == [2, 4, 8], link
        for run in by_world.values():
            counts = run["collectives"]
            assert counts["local_bn"]["collectives"] == counts["unsynced"]["collectives"] == 0
            assert counts["sync_world"]["collectives"] == 2 * len(counts["sync_world"]["channels"])


@pytest.mark.processes
@pytest.mark.timeout(300)
def test_scale_simulation_quick(tmp_path):
    """Two gloo ranks on loopback: the collectives counted per step (one forward and one
    backward all-reduce per synchronized layer, each a frame of the widest layer's size; none
    for a layer in a group of one), each check's fields, every time a measurement."""
    out = tmp_path / "scale.json"
    subprocess.run([sys.executable, str(REPO / "bench" / "scale.py"), "--quick", "--loopback", "--json", str(out)],
                   check=True, cwd=REPO, timeout=280)
    result = json.loads(out.read_text())
    run = result["measured"]["runs"]["loopback"]["2"]
    counts = run["collectives"]
    synced = counts["sync_world"]
    assert synced["collectives"] == 2 * 19 and synced["kinds"] == ["allreduce_"]
    assert synced["bytes"] == [8 * (3 * 64 + 2 * 2)] * (2 * 19)  # frames: ResNet-20's widest layer, 2 ranks
    assert counts["local_bn"]["collectives"] == counts["unsynced"]["collectives"] == 0
    times = [*run["median_step_ms"].values(), *run["latency_us"]["world"].values()]
    assert all(math.isfinite(t) and t > 0 for t in times)
    check = result["measured"]["checks"]["loopback"]["2"]
    assert set(check) == {"alpha_beta", "sync_world"}
    assert set(check["sync_world"]) == {"predicted_sync_ms", "measured_sync_ms", "error"}
