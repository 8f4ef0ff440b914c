"""Train a torchvision ResNet-18 with DeepSpeed (any ZeRO stage) — with the distnorm plugin.

    deepspeed --num_gpus 8 examples/deepspeed_train.py --deepspeed_config configs/deepspeed/zero2_bf16.json --distnorm cbn
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 examples/deepspeed_train.py \\
        --deepspeed_config configs/deepspeed/example_cpu_zero2.json --distnorm cbn --distnorm-bnp

The lines marked ``# distnorm`` are the whole integration; without ``--distnorm`` flags the
script trains exactly as before. Optimizer and LR schedule come from the JSON config.
"""

import argparse

import deepspeed
import torch
import torchvision

import distnorm.integrations.deepspeed as dn  # distnorm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--output-dir", default="runs/deepspeed_example")
    dn.add_arguments(parser)  # distnorm
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()

    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    model = torchvision.models.resnet18(num_classes=10)
    plugin = dn.prepare(model, args)  # distnorm
    dataset = torchvision.datasets.FakeData(size=512, image_size=(3, 32, 32), num_classes=10,
                                            transform=torchvision.transforms.ToTensor())
    engine, _, loader, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters(),
                                                training_data=dataset)
    plugin.follow(engine)  # distnorm

    loss_fn = torch.nn.CrossEntropyLoss()
    step = 0
    for epoch in range(args.epochs):
        for images, labels in loader:
            images, labels = images.to(engine.device), labels.to(engine.device)
            if engine.bfloat16_enabled():
                images = images.bfloat16()
            loss = loss_fn(engine(images).float(), labels)
            engine.backward(loss)
            engine.step()
            step += 1
            if engine.global_rank == 0 and step % 5 == 0:
                print(f"epoch {epoch} step {step} loss {loss.item():.4f} lr {engine.get_lr()[0]:.4f}")
            if args.max_steps and step >= args.max_steps:
                break
    engine.save_checkpoint(args.output_dir, client_state=dn.client_state(plugin))  # distnorm: its state too
    if engine.global_rank == 0:
        print(f"done: {step} steps, checkpoint saved to {args.output_dir}")
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
