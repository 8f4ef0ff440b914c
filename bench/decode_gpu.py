"""JPEG decode + ImageNet training transform: the CPU (PIL) path against the deferred
``decode_device`` path (batched ``torchvision.io.decode_jpeg`` on a device, nvJPEG on CUDA).

    python bench/decode_gpu.py --device cuda --json out.json [--quick]

Needs no WebDataset (it runs on a bare GPU machine): the same synthetic JPEGs of ImageNet's
frame shapes as ``bench/data.py``, in memory. Measures images/s of

* ``pil_1_core``: :meth:`ImageTransform.pixels` + :meth:`~ImageTransform.batch` with the
  ``pil`` decoder on one CPU thread (what one DataLoader worker does per sample);
* ``deferred``: the geometry draws (what the workers do with ``decode_device``) and then
  :meth:`~ImageTransform.finish` on ``--device`` per batch (decode, crop, flip, normalize),
  synchronized; and that ``finish`` alone. On ``--device cpu`` on one thread too.

and how far the device path's tensors lie from PIL's for the same seeds (mean absolute
difference in normalized units): the same crops and flips, another decoder and resize.
"""

from __future__ import annotations

import argparse
import time

import torch

from _common import machine, shown, use_stable_allocator, write_json  # noqa: I001

from distnorm.data.sources import IMAGENET_SHAPES, SyntheticSource
from distnorm.data.transforms import build_transform


def _rate(fn, images: int, device: torch.device, repeats: int) -> float:
    times = []
    for _ in range(repeats + 1):  # the first is the warm-up (CUDA context, nvJPEG handles)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    times = sorted(times[1:])
    return images / times[len(times) // 2]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--repeats", type=int)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    count = 64 if args.quick else 512
    batch = min(args.batch_size, count)
    repeats = args.repeats or (1 if args.quick else 5)
    shapes = tuple((h // 4, w // 4) for h, w in IMAGENET_SHAPES) if args.quick else IMAGENET_SHAPES
    crop = 64 if args.quick else 224
    source = SyntheticSource(num_samples=count, num_classes=10, shapes=shapes)
    blobs = [source.jpeg(i) for i in range(count)]
    pil = build_transform("imagenet", train=True, image_size=crop)
    deferred = build_transform("imagenet", train=True, image_size=crop, decoder="torchvision", decode_device=device)
    batches = [blobs[i:i + batch] for i in range(0, count - batch + 1, batch)]
    images = batch * len(batches)

    def pil_pass():
        for chunk in batches:
            pil.batch([pil.pixels(b) for b in chunk])

    rows = [[deferred.pixels(b) for b in chunk] for chunk in batches]

    def deferred_pass():
        for chunk in batches:
            deferred.finish([deferred.pixels(b) for b in chunk])

    def finish_only():
        for chunk in rows:
            deferred.finish(chunk)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the PIL path as one worker runs it; on --device cpu, all of it
    try:
        rates = {"pil_1_core": _rate(pil_pass, images, torch.device("cpu"), repeats)}
        if device.type != "cpu":
            torch.set_num_threads(threads)
        rates["deferred"] = _rate(deferred_pass, images, device, repeats)
        rates["finish_only"] = _rate(finish_only, images, device, repeats)
    finally:
        torch.set_num_threads(threads)

    diffs = []
    for seed, blob in enumerate(blobs[:16]):
        torch.manual_seed(seed)
        a = pil.batch([pil.pixels(blob)])
        torch.manual_seed(seed)
        b = deferred.finish([deferred.pixels(blob)]).cpu()
        diffs.append(float((a - b).abs().mean()))
    payload = {
        "benchmark": "decode_gpu",
        "machine": machine(),
        "device": str(device),
        "images": images,
        "batch_size": batch,
        "crop": crop,
        "repeats": repeats,
        "images_per_second": rates,
        "ratios": {"deferred_vs_pil_1_core": rates["deferred"] / rates["pil_1_core"],
                   "finish_only_vs_pil_1_core": rates["finish_only"] / rates["pil_1_core"]},
        "mean_abs_diff_vs_pil": sum(diffs) / len(diffs),
    }
    print(f"images/s: {shown(rates, 1)}; ratios {shown(payload['ratios'])}; "
          f"mean |device - PIL| {payload['mean_abs_diff_vs_pil']:.5f}")
    write_json(args.json, payload)
    return payload


if __name__ == "__main__":
    use_stable_allocator()
    main()
