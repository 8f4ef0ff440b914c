"""A training step fed by the recipes' loader from WebDataset shards, against the same step
fed by a batch already on the device, in one run.

    python bench/loader_step.py --device cuda --json loader-gpu.json     # ResNet-18 / 50, bf16, channels_last
    python bench/loader_step.py --quick                                  # the CPU at a tiny size (the tests)

Every GPU figure of the other benchmarks trains on device-resident synthetic tensors; this
one asks whether the loader keeps up. It writes its own shards first: synthetic JPEGs with
ImageNet's frame shapes (:data:`distnorm.data.sources.IMAGENET_SHAPES`, mean 380 x 443) at
JPEG quality ``--quality`` (90), since no dataset can be fetched where it runs: the pixels are
gratings and noise, not photographs, which decode at about the same rate per pixel.

Per model and mode (``eager``, ``compile``: ``torch.compile`` of the model), a step is SGD on
cross-entropy (bf16 autocast on CUDA, channels_last). Windows of ``--steps`` steps alternate,
``--rounds`` times: the step on one batch already on the device (``synthetic``), then the
step fed by :class:`~distnorm.data.TrainLoader` (the ``imagenet`` preset, the recipes'
settings) through :func:`~distnorm.data.to_device` (``--prefetch`` batches ahead), per decoder
variant (``--decoders``: ``pil`` in the DataLoader workers, ``pil+reduced`` with libjpeg's
reduced-size decode, ``torchvision`` there, or ``torchvision-<device>``, decoded in the main
process on the device; PIL-SIMD is not among them: a lent GPU machine cannot install it). Each window is
synchronized at both ends. Per variant:

* ``slowdown``: median loader-fed step time over the median synthetic one (the goal on a
  GPU: at most 1.05);
* ``images_per_s`` of both, and of the loader alone (``loader_alone``, its ceiling: the same
  stream with no model);
* ``cores``: CPU seconds of this process and its DataLoader workers per second of a
  loader-fed window (``/proc``; Linux).

And once, the CPU's cost per image of the worker's pipeline (``cost_per_image_us``, the
``pil`` decoder on one thread; ``bench/data.py``'s profile split): read (the tar members),
decode, geometry (crop, resize, flip), normalize, the rest; and ``transfer``, a pinned
batch's copy to the device per image (none on the CPU). On the CPU the loader alone with 1
and with 2 workers gives the workers' scaling.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from _common import machine, shown, synchronize, use_stable_allocator, write_json  # noqa: I001
from data import profile_split

from distnorm import data as D
from distnorm.data.sources import IMAGENET_SHAPES

#: ``profile_split``'s groups as this benchmark names the stages.
STAGES = {"tar": "read", "decode": "decode", "geometry": "geometry", "normalization": "normalize", "rest": "rest"}


def get_args_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--quick", action="store_true", help="tiny: ResNet-18 at 32 px, a few steps (the tests)")
    parser.add_argument("--models", nargs="+", choices=("resnet18", "resnet50"))
    parser.add_argument("--modes", nargs="+", choices=("eager", "compile"))
    parser.add_argument("--decoders", nargs="+",
                        help="pil, pil+reduced, torchvision, or torchvision-<device> (decoded there)")
    parser.add_argument("--workers", type=int, nargs="+", help="DataLoader workers of each loader-fed window")
    parser.add_argument("--batch-size", type=int, help="per-step batch (256 on CUDA, 8 with --quick)")
    parser.add_argument("--image-size", type=int, help="training crop (224; 32 with --quick)")
    parser.add_argument("--images", type=int, help="JPEGs in the shards (2048; 64 with --quick)")
    parser.add_argument("--quality", type=int, default=90, help="JPEG quality of the shards")
    parser.add_argument("--steps", type=int, help="steps per window (20; 2 with --quick)")
    parser.add_argument("--rounds", type=int, help="alternating windows per variant (3; 1 with --quick)")
    parser.add_argument("--prefetch", type=int, default=1, help="batches copied to the device ahead (to_device)")
    return parser


def settings(args: argparse.Namespace) -> argparse.Namespace:
    """The options left unset, from the device and ``--quick``."""
    cuda, quick = args.device.startswith("cuda"), args.quick
    defaults = {
        "models": ["resnet18"] if quick else ["resnet50", "resnet18"],
        "modes": ["eager"] if quick or not cuda else ["eager", "compile"],
        "decoders": ["pil", "pil+reduced", f"torchvision-{args.device}"] if cuda else ["pil"],
        "workers": [1, 2] if not cuda else [max(1, min(12, (os.cpu_count() or 2) - 2))],
        "batch_size": 8 if quick else (256 if cuda else 32),
        "image_size": 32 if quick else 224,
        "images": 64 if quick else 2048,
        "steps": 2 if quick else 20,
        "rounds": 1 if quick else 3,
    }
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def write_shards(root: Path, args: argparse.Namespace) -> tuple[list[str], D.ShardIndex, dict]:
    shapes = tuple((h // 4, w // 4) for h, w in IMAGENET_SHAPES) if args.quick else IMAGENET_SHAPES
    source = D.SyntheticSource(num_samples=args.images, num_classes=1000, shapes=shapes, quality=args.quality)
    index = D.write_shards(source, str(root / "train"), maxcount=max(args.images // 8, 8), progress=False,
                           workers=max(1, min(8, (os.cpu_count() or 1) // 2)))
    facts = {"images": args.images, "jpeg_quality": args.quality,
             "mean_shape_hw": [statistics.mean(s[i] for s in shapes) for i in (0, 1)],
             "mean_jpeg_bytes": sum(shard.size or 0 for shard in index.shards) / args.images,
             "synthetic": "gratings and noise at ImageNet's frame shapes, written by this benchmark: "
                          "no dataset can be fetched where it runs"}
    return index.local_urls(root), index, facts


def loader_options(decoder: str, workers: int, args: argparse.Namespace) -> dict:
    """The loader's keywords for a ``--decoders`` entry: ``pil``, ``pil+reduced`` (libjpeg's
    reduced-size decode where the crop allows it), ``torchvision``, ``torchvision-<device>``."""
    name, _, reduced = decoder.partition("+")
    name, _, device = name.partition("-")
    return {"transform": "imagenet", "image_size": args.image_size, "decoder": name, "reduced_decode": bool(reduced),
            "decode_device": device or None, "num_workers": workers, "shuffle_buffer": 256,
            "pin_memory": args.device.startswith("cuda")}


def batch_stream(urls: list[str], index: D.ShardIndex, options: dict, args: argparse.Namespace, device: torch.device):
    """Endless ``(images, labels)`` on ``device``: one long epoch of resampled shards (the
    loader's training stream), so no window pays a worker start."""
    steps = 10_000
    loader = D.TrainLoader(urls, num_samples=steps * args.batch_size, batch_size=args.batch_size, **options)
    for epoch in itertools.count():
        loader.set_epoch(epoch)
        yield from D.to_device(loader, device, args.prefetch)


class Cpu:
    """CPU seconds of this process and its children (the DataLoader workers), from ``/proc``."""

    def __init__(self) -> None:
        self.tick = os.sysconf("SC_CLK_TCK")

    def _children(self) -> list[int]:
        pids = []
        for task in Path(f"/proc/{os.getpid()}/task").iterdir():
            children = task / "children"
            if children.exists():
                pids += [int(p) for p in children.read_text().split()]
        return pids

    def seconds(self) -> float:
        total = time.process_time()
        for pid in self._children():
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:  # the child ended
                continue
            total += (int(fields[11]) + int(fields[12])) / self.tick  # utime, stime
        return total


class Trainer:
    """One model's SGD step (bf16 autocast and channels_last on CUDA), eager or compiled."""

    def __init__(self, name: str, mode: str, device: torch.device):
        import torchvision

        torch.manual_seed(0)
        self.device = device
        self.model = getattr(torchvision.models, name)(num_classes=1000).to(device, memory_format=torch.channels_last)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)
        self.forward = torch.compile(self.model) if mode == "compile" else self.model
        self.loss = nn.CrossEntropyLoss()

    def step(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        images = images.contiguous(memory_format=torch.channels_last)
        self.opt.zero_grad(set_to_none=True)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.device.type == "cuda"):
            loss = self.loss(self.forward(images), labels)
        loss.backward()
        self.opt.step()


def window(run_step, steps: int, device: torch.device, cpu: Cpu) -> tuple[float, float]:
    """Seconds per step and CPU cores busy over ``steps`` calls, synchronized at both ends."""
    synchronize(device)
    start, busy = time.perf_counter(), cpu.seconds()
    for _ in range(steps):
        run_step()
    synchronize(device)
    wall = time.perf_counter() - start
    return wall / steps, (cpu.seconds() - busy) / wall


def cost_per_image(urls: list[str], index: D.ShardIndex, args: argparse.Namespace, device: torch.device) -> dict:
    """Microseconds of one worker's pipeline per image by stage (the ``pil`` decoder, one
    thread), and of a pinned batch's copy to ``device``."""
    count = min(index.total, 8 * args.batch_size)
    loader = D.TrainLoader(urls, num_samples=count, batch_size=args.batch_size,
                           **{**loader_options("pil", 0, args), "pin_memory": False})
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:  # the time of a plain pass, split as a profiled pass splits it (the profiler's own cost left out)
        start = time.process_time()
        for _ in loader:
            pass
        per_image = (time.process_time() - start) / (len(loader) * args.batch_size) * 1e6
    finally:
        torch.set_num_threads(threads)
    split = profile_split(loader)
    costs = {STAGES[k]: v * per_image for k, v in split.items()}
    costs["transfer"] = 0.0
    if device.type == "cuda":
        batch = torch.randn(args.batch_size, 3, args.image_size, args.image_size).pin_memory()
        batch.to(device, non_blocking=True)
        synchronize(device)
        start = time.perf_counter()
        for _ in range(10):
            batch.to(device, non_blocking=True)
        synchronize(device)
        costs["transfer"] = (time.perf_counter() - start) / 10 / args.batch_size * 1e6
    costs["total"] = sum(costs.values())
    return costs


def loader_alone(stream, workers: int, args: argparse.Namespace, device: torch.device, cpu: Cpu) -> float:
    """Images/s of ``stream`` with no model (the loader's ceiling), after the batches its
    workers and the prefetch hold ready are taken untimed (they were made while steps ran)."""
    for _ in range(2 * workers + args.prefetch + 1):  # the DataLoader's prefetch_factor 2 per worker
        next(stream)
    steps = max(args.steps, 4 * workers)
    seconds, _ = window(lambda: next(stream), steps, device, cpu)
    return args.batch_size / seconds


def measure(name: str, mode: str, urls, index, args, device: torch.device, cpu: Cpu) -> dict:
    trainer = Trainer(name, mode, device)
    synthetic = (torch.randn(args.batch_size, 3, args.image_size, args.image_size, device=device),
                 torch.randint(0, 1000, (args.batch_size,), device=device))
    feeds = {f"{decoder}_{workers}w": (decoder, workers) for decoder in args.decoders for workers in args.workers}
    streams = {key: batch_stream(urls, index, loader_options(decoder, workers, args), args, device)
               for key, (decoder, workers) in feeds.items()}
    steps = {"synthetic": lambda: trainer.step(*synthetic)}
    for key, stream in streams.items():
        steps[key] = lambda stream=stream: trainer.step(*next(stream))
    for run_step in steps.values():  # warm-up: compilation, the workers' start, the shuffle buffers
        for _ in range(2):
            run_step()
    times: dict[str, list[float]] = {k: [] for k in steps}
    cores: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(args.rounds):
        for key, run_step in steps.items():
            seconds, busy = window(run_step, args.steps, device, cpu)
            times[key].append(seconds)
            cores[key].append(busy)
    alone = {key: loader_alone(stream, feeds[key][1], args, device, cpu) for key, stream in streams.items()}
    base = statistics.median(times["synthetic"])
    result = {"synthetic": {"step_ms": base * 1e3, "images_per_s": args.batch_size / base,
                            "cores": statistics.median(cores["synthetic"])}}
    for key in streams:
        median = statistics.median(times[key])
        result[key] = {"step_ms": median * 1e3, "images_per_s": args.batch_size / median,
                       "slowdown": median / base, "slowdown_per_round": [t / s for t, s in zip(times[key], times["synthetic"])],
                       "loader_alone_images_per_s": alone[key], "cores": statistics.median(cores[key])}
    for stream in streams.values():
        stream.close()  # the workers stop here, not at exit
    return result


def main(argv=None) -> dict:
    args = settings(get_args_parser().parse_args(argv))
    device = torch.device(args.device)
    cpu = Cpu()
    with tempfile.TemporaryDirectory() as tmp:
        urls, index, facts = write_shards(Path(tmp), args)
        results = {f"{name}_{mode}": measure(name, mode, urls, index, args, device, cpu)
                   for name in args.models for mode in args.modes}
        costs = cost_per_image(urls, index, args, device)
        scaling = None
        if device.type == "cpu":  # the workers' scaling, the loader alone
            rates = {}
            for workers in (1, 2):
                stream = batch_stream(urls, index, loader_options("pil", workers, args), args, device)
                rates[workers] = loader_alone(stream, workers, args, device, cpu)
                stream.close()
            scaling = {"images_per_s": rates, "two_vs_one": rates[2] / rates[1]}
    payload = {"benchmark": "loader_step", "machine": machine(), "device": str(device), "cpu_count": os.cpu_count(),
               "shards": facts, "batch_size": args.batch_size, "image_size": args.image_size, "steps": args.steps,
               "rounds": args.rounds, "prefetch": args.prefetch, "decoders": args.decoders, "workers": args.workers,
               "results": results, "cost_per_image_us": costs, "workers_scaling": scaling,
               "ratios": {f"{run}_{key}": entry["slowdown"] for run, variants in results.items()
                          for key, entry in variants.items() if key != "synthetic"}}
    for run, variants in results.items():
        print(f"{run}: " + "; ".join(f"{key} {entry['step_ms']:.1f} ms/step, {entry['images_per_s']:.0f} img/s"
                                     + (f", {entry['slowdown']:.3f}x, alone {entry['loader_alone_images_per_s']:.0f} "
                                        f"img/s, {entry['cores']:.1f} cores" if "slowdown" in entry else "")
                                     for key, entry in variants.items()))
    print(f"CPU per image, us (pil, one thread): {json.dumps(shown(costs, 1))}")
    if scaling:
        print(f"loader alone, 1 -> 2 workers: {shown(scaling['images_per_s'], 1)} img/s ({scaling['two_vs_one']:.2f}x)")
    write_json(args.json, payload)
    return payload


if __name__ == "__main__":
    use_stable_allocator()
    main()
