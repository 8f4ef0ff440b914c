"""Train a torchvision ResNet-18 with plain PyTorch DistributedDataParallel — with the distnorm plugin.

    torchrun --nproc_per_node 2 examples/ddp_train.py --distnorm cbn --max-steps 4          # CPU, gloo
    torchrun --nproc_per_node 8 examples/ddp_train.py --distnorm cbn --distnorm-cbn-rho 2 --distnorm-bnp

The lines marked ``# distnorm`` are the whole integration; without ``--distnorm`` flags the
script trains exactly as before.
"""

import argparse
import os

import torch
import torch.distributed as dist
import torchvision

import distnorm  # distnorm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=16, help="per process")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--max-steps", type=int, default=None)
    distnorm.add_arguments(parser)  # distnorm
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")

    model = torchvision.models.resnet18(num_classes=10)
    plugin = distnorm.DistNormPlugin(model, distnorm.DistNormConfig.from_args(args))  # distnorm
    model.to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4)
    model = torch.nn.parallel.DistributedDataParallel(
        model, device_ids=[local_rank] if cuda else None, **distnorm.ddp_kwargs())  # distnorm: no buffer broadcast
    plugin.follow(optimizer)  # distnorm: AMAT reads the optimizer's learning rate

    dataset = torchvision.datasets.FakeData(size=512, image_size=(3, 32, 32), num_classes=10,
                                            transform=torchvision.transforms.ToTensor())
    sampler = torch.utils.data.DistributedSampler(dataset, shuffle=True, drop_last=True)
    loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs * len(loader))

    loss_fn = torch.nn.CrossEntropyLoss()
    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for images, labels in loader:
            loss = loss_fn(model(images.to(device)), labels.to(device))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
            step += 1
            if dist.get_rank() == 0 and step % 2 == 0:
                print(f"epoch {epoch} step {step} loss {loss.item():.4f} lr {scheduler.get_last_lr()[0]:.4f}")
            if args.max_steps and step >= args.max_steps:
                break
    distnorm.check_consistency(model, parameters=True)  # every buffer and parameter equal on every rank
    if dist.get_rank() == 0:
        print(f"done: {step} steps, {plugin!r}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
