"""Training-pipeline throughput: WebDataset shards against torchvision ImageFolder, and against
the JPEG decode limit.

    python bench/data.py --json bench/results/data-cpu.json [--quick]

Writes the same synthetic JPEGs of ImageNet's frame shapes (``distnorm.data.sources.
IMAGENET_SHAPES``, mean 380 x 443) once as an ImageFolder tree and once as shards (made
*from* that tree, so the JPEG bytes are identical), then measures images/s of decode + the
ImageNet training transform (RandomResizedCrop 224, flip, ToTensor, Normalize) + batching,
with 1 and 2 DataLoader workers:

* ``wds``: ``distnorm.data.TrainLoader`` with the ``imagenet`` preset;
* ``imagefolder``: ``torchvision.datasets.ImageFolder`` + ``DataLoader(shuffle=True)`` with
  torchvision's ``Compose`` of the same steps (what an ImageFolder script writes);
* ``imagefolder_preset``: ImageFolder with distnorm's preset object as its transform (how
  much of the difference is the transform, how much the format);
* ``wds_reduced``: ``TrainLoader(reduced_decode=True)``.

Each measurement is a full pass including worker start-up; the variants are interleaved and
the median of the repeats is reported. Ratios > 1 mean WebDataset is faster. Every image is
checked to give bit-identical tensors through the loader's path and torchvision's
``Compose`` for the same seed.

**Decode limit**: one core decoding the same files with PIL (``Image.open`` + ``load``, what
both loaders use) and with ``torchvision.io.decode_jpeg``; the loader's 1-worker rate as a
fraction of PIL's. **Profile**: a cProfile of a 0-worker pass of the loader, its time split
into decode, geometry (crop / resize / flip), normalization, reading the tar shards, and the
rest (shuffle, seeding, batching, Python).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import tempfile
import time
from pathlib import Path

import torch

from _common import interleaved_medians, machine, shown, use_stable_allocator, write_json  # noqa: I001

from distnorm import data as D
from distnorm.data.sources import IMAGENET_SHAPES

PROFILE_GROUPS = {  # (file path ending, function): cumulative time; function "": own time of every function
    # Full decodes (ImageFile.load) and decodes stopped at the crop's bottom edge (_jpeg_rows).
    "decode": [("PIL/ImageFile.py", "load"), ("distnorm/data/transforms.py", "_jpeg_rows")],
    # The flip's forward; RandomResizedCrop's draw and crop + resize, which the preset calls
    # directly (its forward, where a path calls it, would count them twice).
    "geometry": [("torchvision/transforms/transforms.py", "forward"), ("torchvision/transforms/transforms.py", "get_params"),
                 ("torchvision/transforms/functional.py", "resized_crop")],
    "normalization": [("distnorm/data/transforms.py", "_normalize_into")],
    # distnorm's member reader (cumulative: its reads), WebDataset's grouping, tarfile where
    # a shard falls back to it (not these: distnorm-shards writes plain ustar).
    "tar": [("distnorm/data/tars.py", "_expand"), ("/tarfile.py", ""), ("webdataset/tariterators.py", "")],
}


def make_tree(root: Path, num_images: int, shapes, size: int, classes: int) -> list[Path]:
    source = D.SyntheticSource(num_samples=num_images, num_classes=classes, image_size=size, shapes=shapes)
    files = []
    for i in range(num_images):
        folder = root / source.classes[source.label(i)]
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{source.key(i)}.JPEG"
        path.write_bytes(source.jpeg(i))
        files.append(path)
    return files


def decode_rates(files: list[Path], repeats: int) -> dict[str, float]:
    """Images/s of decoding alone, one core, files already in memory."""
    from PIL import Image
    from torchvision.io import decode_jpeg

    blobs = [f.read_bytes() for f in files]
    tensors = [torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in blobs]

    def pil():
        for b in blobs:
            with Image.open(io.BytesIO(b)) as image:
                image.load()

    def torchvision_io():
        for t in tensors:
            decode_jpeg(t)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        medians = interleaved_medians({"pil": pil, "torchvision_io": torchvision_io}, repeats, torch.device("cpu"),
                                      warmup=1)
    finally:
        torch.set_num_threads(threads)
    return {k: len(blobs) / v for k, v in medians.items()}


def batch_buffer_ms(shape: tuple[int, ...], repeats: int) -> dict[str, float]:
    """Milliseconds to write a float32 batch into a fresh shared-memory buffer (what a
    worker's ``default_collate`` does per batch) and into one written before (what a
    ``distnorm.data.batches`` pool reuses), one thread as in a worker."""
    from distnorm.data.batches import shared_tensor

    source, reused = torch.rand(shape), torch.empty(shape).share_memory_()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        medians = interleaved_medians({"fresh_shared": lambda: shared_tensor(shape, torch.float32).copy_(source),
                                       "reused_shared": lambda: reused.copy_(source)},
                                      max(repeats, 5) * 3, torch.device("cpu"), warmup=1)
    finally:
        torch.set_num_threads(threads)
    return {k: v * 1e3 for k, v in medians.items()}


def profile_split(loader) -> dict[str, float]:
    """Fractions of a 0-worker pass's time per stage (cProfile's internal time per leaf), on
    one torch thread as in a DataLoader worker (with two, the small per-image tensor ops
    spin on a busy machine: normalization measured 3.5 % of the pass one day, 28 % another)."""
    profiler = cProfile.Profile()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        start = time.perf_counter()
        profiler.enable()
        for _ in loader:
            pass
        profiler.disable()
        total = time.perf_counter() - start
    finally:
        torch.set_num_threads(threads)
    stats = pstats.Stats(profiler).stats
    split = dict.fromkeys([*PROFILE_GROUPS, "rest"], 0.0)
    for group, leaves in PROFILE_GROUPS.items():
        for (filename, _line, func), (_cc, _nc, own, cumulative, _callers) in stats.items():
            for ending, name in leaves:
                if filename.endswith(ending) and (not name or func == name):
                    split[group] += cumulative if name else own
    split["rest"] = max(total - sum(split.values()), 0.0)
    return {k: v / total for k, v in split.items()}


def check_same_tensors(files: list[Path], transform, count: int | None = None) -> bool:
    """The loader's path (pixels, then batch normalization) equals torchvision's Compose, on
    every file (the first ``count``); each seed draws another crop and flip."""
    from PIL import Image
    from torchvision import transforms as T

    reference = T.Compose([*transform.geometry, T.ToTensor(), T.Normalize(transform.mean, transform.std)])
    for seed, path in enumerate(files[:count]):
        torch.manual_seed(seed)
        with Image.open(path) as image:
            expected = reference(image.convert("RGB"))
        torch.manual_seed(seed)
        got = transform.batch([transform.pixels(path.read_bytes())])[0]
        if not torch.equal(expected, got):
            return False
    return True


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int)
    parser.add_argument("--num-images", type=int)
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args(argv)
    num_images = args.num_images or (64 if args.quick else 1024)
    shapes = tuple((h // 4, w // 4) for h, w in IMAGENET_SHAPES) if args.quick else IMAGENET_SHAPES
    crop = 64 if args.quick else 224
    repeats = args.repeats or (1 if args.quick else 5)

    import torchvision
    from torchvision import transforms as T

    with tempfile.TemporaryDirectory() as tmp:
        tree, shards = Path(tmp) / "tree", Path(tmp) / "shards"
        files = make_tree(tree, num_images, shapes, crop, classes=10)
        index = D.write_shards(D.ImageFolderSource(str(tree)), str(shards / "train"), maxcount=128, progress=False)
        urls = index.local_urls(shards)
        preset = D.build_transform("imagenet", train=True, image_size=crop)
        compose = T.Compose([*preset.geometry, T.ToTensor(), T.Normalize(preset.mean, preset.std)])

        def wds_pass(workers: int, reduced: bool = False):
            loader = D.TrainLoader(urls, num_samples=index.total, batch_size=args.batch_size, num_workers=workers,
                                   transform="imagenet", image_size=crop, reduced_decode=reduced,
                                   shuffle_buffer=256, pin_memory=False)
            return lambda: sum(x.shape[0] for x, _ in loader)

        def folder_pass(workers: int, transform):
            dataset = torchvision.datasets.ImageFolder(str(tree), transform=transform)
            loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, shuffle=True,
                                                 num_workers=workers, drop_last=True)
            return lambda: sum(x.shape[0] for x, _ in loader)

        fns, counts = {}, {}
        for workers in (1, 2):
            variants = {"wds": wds_pass(workers), "imagefolder": folder_pass(workers, compose),
                        "imagefolder_preset": folder_pass(workers, preset), "wds_reduced": wds_pass(workers, True)}
            for name, run in variants.items():
                counts[f"{name}_{workers}"] = run()  # also the warm-up (page cache, imports)
                fns[f"{name}_{workers}"] = run
        medians = interleaved_medians(fns, repeats, torch.device("cpu"), warmup=0)
        decode = decode_rates(files, repeats)
        buffers = batch_buffer_ms((args.batch_size, 3, crop, crop), repeats)
        same = check_same_tensors(files, preset)
        profile = profile_split(D.TrainLoader(urls, num_samples=index.total, batch_size=args.batch_size, num_workers=0,
                                              transform="imagenet", image_size=crop, shuffle_buffer=256,
                                              pin_memory=False))
        mean_bytes = sum(f.stat().st_size for f in files) / len(files)

    ips = {k: counts[k] / medians[k] for k in fns}
    payload = {
        "benchmark": "data",
        "machine": machine(),
        "images": num_images,
        "mean_shape_hw": [sum(s[i] for s in shapes) / len(shapes) for i in (0, 1)],
        "mean_jpeg_bytes": mean_bytes,
        "crop": crop,
        "batch_size": args.batch_size,
        "repeats": repeats,
        "images_per_pass": counts,
        "images_per_second": ips,
        "same_tensors_as_torchvision_compose": same,
        "decode_only_images_per_second_1_core": decode,
        "loader_1worker_fraction_of_pil_decode": ips["wds_1"] / decode["pil"],
        "profile_fraction_0_workers": profile,
        "batch_buffer_write_ms": buffers,
        "scaling_1_to_2_workers": {n: ips[f"{n}_2"] / ips[f"{n}_1"] for n in ("wds", "imagefolder")},
        "ratios": {
            "wds_vs_imagefolder_1worker": ips["wds_1"] / ips["imagefolder_1"],
            "wds_vs_imagefolder_2workers": ips["wds_2"] / ips["imagefolder_2"],
            "wds_vs_imagefolder_preset_1worker": ips["wds_1"] / ips["imagefolder_preset_1"],
            "wds_vs_imagefolder_preset_2workers": ips["wds_2"] / ips["imagefolder_preset_2"],
            "reduced_vs_full_decode_1worker": ips["wds_reduced_1"] / ips["wds_1"],
            "reduced_vs_full_decode_2workers": ips["wds_reduced_2"] / ips["wds_2"],
        },
    }
    print(f"images/s: {shown(ips, 1)}")
    print(f"decode only, 1 core: {shown(decode, 1)}; loader (1 worker) = "
          f"{payload['loader_1worker_fraction_of_pil_decode']:.3f} of PIL's")
    print(f"profile (0 workers): {shown(profile)}")
    print(f"a batch written into a fresh / a reused shared buffer, ms: {shown(buffers, 2)}")
    print(f"same tensors as torchvision's Compose: {same}")
    print(f"ratios: {json.dumps(shown(payload['ratios'], 4))}")
    write_json(args.json, payload)
    return payload


if __name__ == "__main__":
    use_stable_allocator()
    main()
