"""A run's trained model out of distnorm: written at the end of ``distnorm-train`` as
:func:`distnorm.freeze` gives it, and evaluated from that file (``distnorm-train --evaluate``).

* ``<output.dir>/model-frozen.pt``: the evaluation-mode model in plain ``torch.nn`` modules
  (``torch.save`` of the module, on the CPU): ``torch.load(path, weights_only=False)`` where
  the architecture's code is importable (torchvision, timm; distnorm's own zoo for its CIFAR
  models), no distnorm layer needed;
* ``<output.dir>/model-frozen.onnx`` where the ``[export]`` extra is installed (``onnx``,
  ``onnxscript``): the same model through ``torch.onnx.export`` (torch.export's exporter),
  input ``images`` with a dynamic batch dimension, output ``logits``; any ONNX runtime runs it.

A model whose parameters are sharded across ranks (DeepSpeed ZeRO-3) is not written: the
run says so and names what to do.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from distnorm.data import evaluate
from distnorm.serving import freeze

__all__ = ["FROZEN", "ONNX", "evaluate_frozen", "write_frozen"]

logger = logging.getLogger(__name__)

FROZEN = "model-frozen.pt"
ONNX = "model-frozen.onnx"


def write_frozen(model: nn.Module, run_dir: Path, image_size: int) -> list[Path]:
    """Freeze the trained ``model`` and write it into ``run_dir`` (main rank only; no
    collective). Returns the files written."""
    try:
        frozen = freeze(model).cpu()
    except (TypeError, ValueError) as err:
        logger.warning("distnorm-train: %s not written: %s", FROZEN, err)
        return []
    written = [run_dir / FROZEN]
    try:
        torch.save(frozen, written[0])
    except Exception as err:  # noqa: BLE001 - whatever cannot be pickled: said, and the run's result stands
        written[0].unlink(missing_ok=True)
        logger.warning("distnorm-train: %s not written: the frozen model does not pickle (%s: %s)", FROZEN,
                       type(err).__name__, err)
        return []
    if importlib.util.find_spec("onnx") is not None and importlib.util.find_spec("onnxscript") is not None:
        dtype = next(frozen.parameters()).dtype
        images = torch.zeros(2, 3, image_size, image_size, dtype=dtype)
        try:
            torch.onnx.export(frozen, (images,), str(run_dir / ONNX), dynamo=True, input_names=["images"],
                              output_names=["logits"], dynamic_shapes=({0: torch.export.Dim("batch")},),
                              external_data=_over_2gb(frozen), verbose=False)  # one file where a protobuf holds it
            written.append(run_dir / ONNX)
        except Exception as err:  # noqa: BLE001 - the exporter's own error: said, and the run's result stands
            logger.warning("distnorm-train: %s not written: torch.onnx.export failed (%s: %s)", ONNX,
                           type(err).__name__, err)
    return written


def _over_2gb(model: nn.Module) -> bool:
    """Whether the weights exceed what one ONNX file (a protobuf) can hold."""
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()]) >= 2 ** 31 - 2 ** 26


def evaluate_frozen(path: str | Path, loader: Any, device: torch.device) -> dict[str, float]:
    """Top-1 / top-5 / loss of the frozen model at ``path`` over ``loader``'s batches (an
    :class:`~distnorm.data.EvalLoader`), reduced over the ranks when a process group exists."""
    model = torch.load(path, map_location=device, weights_only=False)
    if not isinstance(model, nn.Module):
        raise ValueError(f"--evaluate {path}: the file holds a {type(model).__name__}, not a model "
                         f"(distnorm-train writes {FROZEN} at the end of a run)")
    dtype = next(model.parameters()).dtype
    return evaluate(model, loader, device=device, cast=lambda images: images.to(dtype))
