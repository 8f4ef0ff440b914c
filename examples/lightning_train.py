"""Train a torchvision ResNet-18 with PyTorch Lightning — with distnorm.

    python examples/lightning_train.py --accelerator cpu --devices 2 --distnorm cbn
    python examples/lightning_train.py --devices 8 --distnorm cbn --distnorm-cbn-rho 2 --distnorm-bnp
    python examples/lightning_train.py --devices 8 --distnorm cbn --resume runs/lightning_example/last.ckpt

Lightning's DDP strategy starts the other processes itself. The lines marked ``# distnorm``
are the whole integration; without ``--distnorm`` flags the script trains exactly as before.
"""

import argparse

import lightning as L
import torch
import torchvision
from lightning.pytorch.callbacks import ModelCheckpoint

import distnorm.integrations.lightning as dn  # distnorm


class Classifier(L.LightningModule):
    def __init__(self, lr: float, total_steps: int):
        super().__init__()
        self.model = torchvision.models.resnet18(num_classes=10)
        self.loss_fn = torch.nn.CrossEntropyLoss()
        self.lr, self.total_steps = lr, total_steps

    def forward(self, images):
        return self.model(images)

    def training_step(self, batch, batch_idx):
        images, labels = batch
        loss = self.loss_fn(self(images), labels)
        if self.global_step % 5 == 0:
            lr = self.trainer.optimizers[0].param_groups[0]["lr"]
            self.print(f"step {self.global_step} loss {loss.item():.4f} lr {lr:.4f}")
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9, weight_decay=1e-4)
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=self.total_steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--accelerator", default="auto")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--max-steps", type=int, default=-1)
    parser.add_argument("--output-dir", default="runs/lightning_example")
    parser.add_argument("--resume", default=None, help="a checkpoint to resume from")
    dn.add_arguments(parser)  # distnorm
    args = parser.parse_args()

    dataset = torchvision.datasets.FakeData(size=512, image_size=(3, 32, 32), num_classes=10,
                                            transform=torchvision.transforms.ToTensor())
    loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, shuffle=True, drop_last=True)
    total = args.max_steps if args.max_steps > 0 else args.epochs * len(loader) // args.devices
    sync = dn.DistNormSync(args)  # distnorm
    trainer = L.Trainer(
        accelerator=args.accelerator, devices=args.devices, strategy="ddp", max_epochs=args.epochs,
        max_steps=args.max_steps, logger=False, enable_progress_bar=False,
        plugins=[sync],  # distnorm
        callbacks=[sync, ModelCheckpoint(dirpath=args.output_dir, save_last=True)],  # distnorm: sync
    )
    trainer.fit(Classifier(args.lr, total), loader, ckpt_path=args.resume)
    if trainer.is_global_zero:
        print(f"done: {trainer.global_step} steps, checkpoints in {args.output_dir}")


if __name__ == "__main__":
    main()
