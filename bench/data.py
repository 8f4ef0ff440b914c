"""Training-pipeline throughput: WebDataset shards against torchvision ImageFolder.

    python bench/data.py --json bench/results/data-cpu.json [--quick]

Writes the same synthetic ImageNet-shaped JPEGs once as an ImageFolder tree and once as
shards (made *from* that tree, so the JPEG bytes are identical), then measures images/s of
decode + the ImageNet training transform (RandomResizedCrop 224, flip, normalize) + batching,
with 1 and 2 DataLoader workers: ``distnorm.data.TrainLoader`` against
``torchvision.datasets.ImageFolder`` + ``DataLoader(shuffle=True)``. Each measurement is a
full pass including worker start-up; the variants are interleaved and the median of the
repeats is reported. Ratios > 1 mean WebDataset is faster.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from _common import interleaved_medians, machine, use_stable_allocator, write_json  # noqa: I001

from distnorm import data as D


def make_tree(root: Path, num_images: int, size: int, classes: int) -> None:
    source = D.SyntheticSource(num_samples=num_images, num_classes=classes, image_size=size)
    for i in range(num_images):
        folder = root / source.classes[source.label(i)]
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{source.key(i)}.JPEG").write_bytes(source.jpeg(i))


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int)
    parser.add_argument("--num-images", type=int)
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args(argv)
    num_images = args.num_images or (64 if args.quick else 1024)
    size = 96 if args.quick else 320  # source resolution (ImageNet images average ~400x350)
    crop = 64 if args.quick else 224
    repeats = args.repeats or (1 if args.quick else 3)

    with tempfile.TemporaryDirectory() as tmp:
        tree, shards = Path(tmp) / "tree", Path(tmp) / "shards"
        make_tree(tree, num_images, size, classes=10)
        index = D.write_shards(D.ImageFolderSource(str(tree)), str(shards / "train"), maxcount=128, progress=False)
        urls = index.local_urls(shards)
        import torchvision

        transform = D.build_transform("imagenet", train=True, image_size=crop)

        def wds_pass(workers: int):
            loader = D.TrainLoader(urls, num_samples=index.total, batch_size=args.batch_size, num_workers=workers,
                                   transform=transform, shuffle_buffer=256, pin_memory=False)
            return lambda: sum(x.shape[0] for x, _ in loader)

        def folder_pass(workers: int):
            dataset = torchvision.datasets.ImageFolder(str(tree), transform=transform)
            loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, shuffle=True,
                                                 num_workers=workers, drop_last=True)
            return lambda: sum(x.shape[0] for x, _ in loader)

        fns, counts = {}, {}
        for workers in (1, 2):
            for name, make in (("wds", wds_pass), ("imagefolder", folder_pass)):
                run = make(workers)
                counts[f"{name}_{workers}"] = run()  # also the warm-up (page cache)
                fns[f"{name}_{workers}"] = run
        medians = interleaved_medians(fns, repeats, torch.device("cpu"), warmup=0)

    ips = {k: round(counts[k] / medians[k], 1) for k in fns}
    payload = {
        "benchmark": "data",
        "machine": machine(),
        "images": num_images,
        "source_size": size,
        "crop": crop,
        "batch_size": args.batch_size,
        "repeats": repeats,
        "images_per_pass": counts,
        "images_per_second": ips,
        "scaling_1_to_2_workers": {n: round(ips[f"{n}_2"] / ips[f"{n}_1"], 3) for n in ("wds", "imagefolder")},
        "ratios": {
            "wds_vs_imagefolder_1worker": round(ips["wds_1"] / ips["imagefolder_1"], 4),
            "wds_vs_imagefolder_2workers": round(ips["wds_2"] / ips["imagefolder_2"], 4),
        },
    }
    print(f"images/s: {ips}")
    print(f"scaling 1 -> 2 workers: {payload['scaling_1_to_2_workers']}")
    print(f"ratios: {json.dumps(payload['ratios'])}")
    write_json(args.json, payload)
    return payload


if __name__ == "__main__":
    use_stable_allocator()
    main()
