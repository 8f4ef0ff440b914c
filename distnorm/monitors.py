"""Theory monitors: the quantities papers 002 and 003 reason about, measured during training.

Off by default and free when off (a layer's ``stats_sink`` is ``None``). When on, a layer
puts references to its fused operator's inputs and outputs in the sink — the batch mean and
variance, the plan's ``center = mu_U - beta`` — at no cost and without computing anything
itself, so a rank with a monitor runs exactly the arithmetic of the others (monitors usually
live on one rank; the layers' buffers must stay bit-identical on all of them). The monitor
derives what it records from those, in float64, when it records. When a
:class:`TheoryMonitor` is attached it records, every ``every`` steps:

* per CBN / POP-Norm layer, quantiles over channels of
  ``eta_k = (mu_B - beta) / E[x]`` (paper 002, Theorem 2 and Fig. 2, which assume
  ``0 < eta_k < 2``; ``E[x]`` is estimated by the AMAT mean ``mu_U`` as the paper does) and of
  ``tau_k = gamma / (rho * sigma_B)`` (Theorem 3, Fig. 3);
* the stochastic-gradient variance (paper 002, Fig. 10; needs gradients in ``.grad``, i.e.
  DDP / Accelerate or ZeRO-0 — ZeRO-1+ partitions them): with exponential averages
  ``m1 = E[g]`` and ``m2 = E[g^2]`` over steps (weight 0.9) of every gradient coordinate, the
  mean of ``m2 - m1^2``, and the gradient norm;
* the norm of the weights made scale-invariant by a normalization that follows them
  (paper 003, Lemma 3, which predicts their growth under SGD), and of all conv / linear
  weights.

Records go to the trainer's metrics stream (``kind: "monitor"``) and ``distnorm-report``
plots them. Use::

    monitor = distnorm.monitors.TheoryMonitor(model, every=50)
    ...
    loss.backward(); monitor.after_backward(step)
    for record in monitor.records(step): writer.log("monitor", **record)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from distnorm.convert import linear_batchnorm_pairs
from distnorm.layers import CBN, POPNorm

__all__ = ["TheoryMonitor", "batch_statistics"]

QUANTILES = (0.05, 0.5, 0.95)


def _scale_invariant_weights(model: nn.Module) -> list[str]:
    """Conv / linear layers whose output goes straight into a BatchNorm (found by torch.fx)."""
    return [op for op, _ in linear_batchnorm_pairs(model)]


def batch_statistics(layer: CBN | POPNorm) -> dict[str, torch.Tensor] | None:
    """The last training batch's statistics of a monitored layer, in float64, or ``None``
    before its first training step (or without a monitor):

    * ``mean``: the batch mean ``mu_B``;
    * ``amat_mean``: ``mu_U`` (``mu_B`` without history), which the layer kept as its AMAT mean;
    * ``sigma``: ``sqrt(var_B + eps)``, with ``var_B = var(x) + d^2`` the second moment of
      ``x1 = x - mu_U + beta`` and ``d = mu_B - mu_U + beta = mu_B - center``.
    """
    sink = layer.stats_sink
    if not sink or "mean" not in sink:
        return None
    mean, var, center = (sink[k].detach().double() for k in ("mean", "var", "center"))
    d = mean - center
    return {"mean": mean, "amat_mean": layer.amat_mean.detach().double(),
            "sigma": torch.sqrt(var + d * d + sink["eps"])}


class TheoryMonitor:
    """Collects the theory quantities of ``model`` (see the module docs).

    Args:
        model: the bare model (not the DDP / engine wrapper).
        every: record every this many steps.
        momentum: weight of the exponential gradient averages.
    """

    def __init__(self, model: nn.Module, every: int = 50, momentum: float = 0.9):
        if every < 1:
            raise ValueError(f"TheoryMonitor: every must be >= 1, got {every}")
        self.every, self.momentum = every, momentum
        self.norm_layers = {name: m for name, m in model.named_modules() if isinstance(m, (CBN, POPNorm))}
        for layer in self.norm_layers.values():
            layer.stats_sink = {}
        invariant = set(_scale_invariant_weights(model))
        self.weights = {name: m.weight for name, m in model.named_modules()
                        if isinstance(m, (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear))}
        self.invariant = [w for n, w in self.weights.items() if n in invariant]
        self.params = [p for p in model.parameters() if p.requires_grad]
        self._m1: list[torch.Tensor] | None = None
        self._m2: list[torch.Tensor] | None = None

    def remove(self) -> None:
        """Turn the per-layer statistics off again."""
        for layer in self.norm_layers.values():
            layer.stats_sink = None

    @torch.no_grad()
    def after_backward(self, step: int) -> None:
        """Fold this step's gradients into the running averages (call before optimizer.step)."""
        grads = [p.grad.detach().float() if p.grad is not None else torch.zeros_like(p, dtype=torch.float32)
                 for p in self.params]
        if self._m1 is None:
            self._m1 = [g.clone() for g in grads]
            self._m2 = [g * g for g in grads]
            return
        w = 1.0 - self.momentum
        for m1, m2, g in zip(self._m1, self._m2, grads):
            m1.lerp_(g, w)
            m2.lerp_(g * g, w)
        self._last_grad_norm = float(torch.sqrt(sum((g * g).sum() for g in grads)))

    @torch.no_grad()
    def records(self, step: int) -> list[dict[str, Any]]:
        """The records of this step (empty unless ``step % every == 0``)."""
        if step % self.every:
            return []
        out = []
        for name, layer in self.norm_layers.items():
            stats = batch_statistics(layer)
            if stats is None:
                continue
            beta, gamma = layer.bias.detach().double(), layer.weight.detach().double()
            expectation = stats["amat_mean"]
            safe = torch.where(expectation.abs() > 1e-12, expectation, torch.full_like(expectation, float("nan")))
            eta = (stats["mean"] - beta) / safe
            tau = gamma / (layer.rho * stats["sigma"])
            record = {"step": step, "layer": name}
            for label, values in (("eta", eta), ("tau", tau)):
                values = values[torch.isfinite(values)]
                if values.numel():
                    q = torch.quantile(values, torch.tensor(QUANTILES, dtype=values.dtype))
                    for quantile, value in zip(QUANTILES, q.tolist()):
                        record[f"{label}_q{int(quantile * 100):02d}"] = value
            finite = eta[torch.isfinite(eta)]
            if finite.numel():  # the share of channels inside Theorem 2's assumption
                record["eta_in_0_2"] = float(((finite > 0) & (finite < 2)).double().mean())
            out.append(record)
        model_record: dict[str, Any] = {"step": step, "layer": "model"}
        if self._m1 is not None:
            numel = sum(m.numel() for m in self._m1)
            variance = sum((m2 - m1 * m1).clamp_min(0).sum() for m1, m2 in zip(self._m1, self._m2))
            model_record["grad_variance"] = float(variance) / max(numel, 1)
            model_record["grad_norm"] = getattr(self, "_last_grad_norm", float("nan"))
        zero = torch.zeros(())  # the start of the sums: a model may have no conv / linear weight
        model_record["weight_norm"] = float(torch.sqrt(sum(((w.detach().float() ** 2).sum() for w in self.weights.values()),
                                                           zero)))
        if self.invariant:
            model_record["weight_norm_scale_invariant"] = float(
                torch.sqrt(sum((w.detach().float() ** 2).sum() for w in self.invariant)))
        out.append(model_record)
        return out
