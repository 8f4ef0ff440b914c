"""Theory monitors, the reproduction driver (smoke budget) and distnorm-report."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import distnorm
from distnorm import models
from distnorm.monitors import TheoryMonitor, batch_statistics


def test_monitors_are_off_by_default_and_record_when_attached():
    model = models.create("resnet20", num_classes=10, norm="cbn")
    cbns = [m for m in model.modules() if isinstance(m, distnorm.CBN)]
    assert all(m.stats_sink is None for m in cbns)
    monitor = TheoryMonitor(model, every=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in (1, 2):
        distnorm.set_lr(model, 0.05)
        loss = torch.nn.functional.cross_entropy(model(torch.randn(8, 3, 32, 32) + 0.5), torch.randint(0, 10, (8,)))
        opt.zero_grad()
        loss.backward()
        monitor.after_backward(step)
        opt.step()
        records = monitor.records(step)
        assert (records == []) == (step == 1)
    layer = records[0]
    # tau_k = gamma / (rho * sigma_B): checked against the layer's own statistics
    tau = (cbns[0].weight.detach().double() / (cbns[0].rho * batch_statistics(cbns[0])["sigma"]))
    assert layer["tau_q50"] == pytest.approx(float(torch.quantile(tau, 0.5)))
    assert 0 <= layer["eta_in_0_2"] <= 1
    assert records[-1]["layer"] == "model" and records[-1]["grad_variance"] >= 0
    monitor.remove()
    assert all(m.stats_sink is None for m in cbns)
    bn_model = models.create("resnet20", num_classes=10, norm="keep")
    assert len(TheoryMonitor(bn_model).invariant) == 19  # the convs followed by BatchNorm


@pytest.mark.parametrize("lr", [0.2, 0.01])  # eta = 0 (no history), 0.9
def test_monitored_statistics_are_the_batch_statistics(lr):
    """What the monitor records comes from the layer's fused operator (its inputs and the
    plan it returned, the same on every rank: the monitored rank computes nothing else),
    checked here against the float64 statistics of the batch itself: ``mu_B``, ``mu_U`` and
    ``sigma_B = sqrt(mean((x - mu_U + beta)^2) + eps)``."""
    torch.manual_seed(0)
    layer = distnorm.CBN(5, rho=1.5)
    with torch.no_grad():
        layer.bias.copy_(torch.randn(5) * 0.3)
    monitor = TheoryMonitor(torch.nn.Sequential(layer), every=1)
    distnorm.set_lr(layer, lr)
    for step in range(3):
        x = torch.randn(16, 5, 4, 4) * (1 + step) + torch.arange(5.0).view(1, 5, 1, 1)
        layer(x).sum().backward()
    stats = batch_statistics(layer)
    x64, beta = x.double(), layer.bias.detach().double().view(1, 5, 1, 1)
    mu_b = x64.mean((0, 2, 3))
    torch.testing.assert_close(stats["mean"], mu_b, rtol=1e-6, atol=1e-6)
    mu_u = stats["amat_mean"]
    if lr >= 0.1:
        torch.testing.assert_close(mu_u, mu_b, rtol=1e-6, atol=1e-6)  # no history: mu_U = mu_B
    sigma = torch.sqrt(((x64 - mu_u.view(1, 5, 1, 1) + beta) ** 2).mean((0, 2, 3)) + layer.eps)
    torch.testing.assert_close(stats["sigma"], sigma, rtol=1e-5, atol=1e-6)
    assert {r["layer"] for r in monitor.records(3)} == {"0", "model"}
    monitor.remove()
    assert batch_statistics(layer) is None


@pytest.mark.processes
@pytest.mark.timeout(600)
def test_repro_quick_writes_table_and_figures(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "distnorm.repro", "digits", "--out", str(tmp_path), "--quick",
                           "--norms", "bn", "cbn", "--workers", "2"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "results.json").read_text())
    assert {(r["norm"], r["activation"]) for r in result["runs"]} == {(n, a) for n in ("bn", "cbn") for a in ("relu", "tanh")}
    assert all(0 <= r["final_accuracy"] <= 100 and len(r["train_loss"]) == 1 for r in result["runs"])
    assert "| cbn |" in (tmp_path / "table.md").read_text() and (tmp_path / "loss_curves.png").stat().st_size > 0
    again = subprocess.run([sys.executable, "-m", "distnorm.repro", "digits", "--from-results", str(tmp_path / "results.json"),
                            "--out", str(tmp_path / "again"), "--publish", str(tmp_path / "pub")],
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    assert (tmp_path / "pub" / "repro_digits_table.md").read_text() == (tmp_path / "table.md").read_text()


@pytest.mark.processes
def test_report_overlays_runs_and_survives_a_truncated_line(tmp_path):
    for name, top1 in (("a", 50.0), ("b", 60.0)):
        run = tmp_path / name
        run.mkdir()
        lines = [{"kind": "train", "step": s, "epoch": 0, "loss": 2.0 / s, "lr": 0.1, "images_per_sec": 100.0} for s in (1, 2)]
        lines += [{"kind": "eval", "step": 2, "epoch": 1, "top1": top1, "top5": 90.0, "loss": 1.0, "count": 10}]
        (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in lines) + '\n{"kind": "tra')
    proc = subprocess.run([sys.executable, "-m", "distnorm.report", str(tmp_path / "a"), str(tmp_path / "b"),
                           "--out", str(tmp_path / "r")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    summary = (tmp_path / "r" / "summary.md").read_text()
    assert "| a | 2 |" in summary and "60.00" in summary
    assert (tmp_path / "r" / "loss.png").is_file() and (tmp_path / "r" / "throughput.png").is_file()
    missing = subprocess.run([sys.executable, "-m", "distnorm.report", str(tmp_path / "nope")], capture_output=True, text=True)
    assert missing.returncode == 2 and "metrics.jsonl" in missing.stderr


def test_schedules_are_drawn_as_steps_and_amat_eta_gets_its_panel(tmp_path):
    """The learning rate and AMAT's eta hold their value between logged steps: drawn as steps,
    a milestone's drop is a drop, not a ramp; a run that logged ``amat_eta`` gets its panel,
    one that did not gets none."""
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    from distnorm import report

    drawn = []
    original = plt.Axes.plot

    def plot(self, *args, **kwargs):  # each panel's axes, read once drawn
        drawn.append(self)
        return original(self, *args, **kwargs)

    for name, eta in (("amat", True), ("plain", False)):
        run = tmp_path / name
        run.mkdir()
        rows = [{"kind": "train", "step": s, "epoch": 0, "loss": 1.0, "lr": 0.1 if s < 20 else 0.01,
                 "images_per_sec": 50.0, **({"amat_eta": 0.0 if s < 20 else 0.9} if eta else {})} for s in (10, 20, 30)]
        (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
        plt.Axes.plot = plot
        try:
            report.write_report([run], run / "report")
        finally:
            plt.Axes.plot = original
        assert (run / "report" / "amat_eta.png").is_file() == eta
    styles = {ax.get_title().split(",")[0]: {line.get_drawstyle() for line in ax.lines} for ax in drawn}
    assert styles["learning rate"] == styles["AMAT's weight on history"] == {"steps-post"}
    assert styles["training loss"] == {"default"}
