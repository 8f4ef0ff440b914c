"""Engine integrations, imported lazily so that ``import distnorm`` needs only torch.

* :mod:`distnorm.integrations.accelerate` — Hugging Face Accelerate (``pip install distnorm[accelerate]``)
* :mod:`distnorm.integrations.deepspeed` — DeepSpeed, ZeRO stages 0–3 (``pip install distnorm[deepspeed]``)
* :mod:`distnorm.integrations.lightning` — PyTorch Lightning: a ``LayerSync`` + ``Callback``
  (``pip install distnorm[lightning]``)

torch FSDP (``fully_shard`` and ``FullyShardedDataParallel``) needs no integration: convert
before sharding, then ``DistNormPlugin.follow(optimizer)`` (see ``docs/guides/fsdp.md``).
"""
