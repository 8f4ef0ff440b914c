"""Train a torchvision ResNet-18 with Hugging Face Accelerate — with the distnorm plugin.

    accelerate launch --cpu --num_processes 2 examples/accelerate_train.py --cpu --distnorm cbn
    torchrun --nproc_per_node 8 examples/accelerate_train.py --distnorm cbn --distnorm-cbn-rho 2 --distnorm-bnp

The lines marked ``# distnorm`` are the whole integration; without ``--distnorm`` flags the
script trains exactly as before. (On CPU, Accelerate runs multi-process only with ``--cpu``.)
"""

import argparse

import torch
import torchvision
from accelerate import Accelerator

import distnorm.integrations.accelerate as dn  # distnorm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--output-dir", default="runs/accelerate_example")
    dn.add_arguments(parser)  # distnorm
    args = parser.parse_args()

    accelerator = Accelerator(cpu=args.cpu)
    model = torchvision.models.resnet18(num_classes=10)
    plugin = dn.prepare(model, args, accelerator)  # distnorm
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4)
    dataset = torchvision.datasets.FakeData(size=512, image_size=(3, 32, 32), num_classes=10,
                                            transform=torchvision.transforms.ToTensor())
    loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, shuffle=True, drop_last=True)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs * len(loader))
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    plugin.follow(optimizer)  # distnorm

    loss_fn = torch.nn.CrossEntropyLoss()
    step = 0
    for epoch in range(args.epochs):
        model.train()
        for images, labels in loader:
            loss = loss_fn(model(images), labels)
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            step += 1
            if accelerator.is_main_process and step % 5 == 0:
                print(f"epoch {epoch} step {step} loss {loss.item():.4f} lr {scheduler.get_last_lr()[0]:.4f}")
            if args.max_steps and step >= args.max_steps:
                break
    accelerator.save_state(args.output_dir)
    if accelerator.is_main_process:
        print(f"done: {step} steps, state saved to {args.output_dir}")
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
