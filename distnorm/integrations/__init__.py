"""Engine integrations, imported lazily so that ``import distnorm`` needs only torch.

* :mod:`distnorm.integrations.accelerate` — Hugging Face Accelerate (``pip install distnorm[accelerate]``)
* :mod:`distnorm.integrations.deepspeed` — DeepSpeed, ZeRO stages 0–3 (``pip install distnorm[deepspeed]``)
* :mod:`distnorm.integrations.lightning` — PyTorch Lightning: a ``LayerSync`` + ``Callback``
  (``pip install distnorm[lightning]``)

torch FSDP (``fully_shard`` and ``FullyShardedDataParallel``) needs no integration: convert
before sharding, then ``DistNormPlugin.follow(optimizer)`` (see ``docs/guides/fsdp.md``).

Each module is named after its engine's library and registers, once, everything distnorm
knows about that engine as one :class:`distnorm._engines.Engine` (its ``ENGINE``): the
types that wrap a model, how the plugin follows the engine and which parameters it
partitions; the module's own functions carry the plugin's state in the engine's own
checkpoints. An object of the library
met by distnorm loads the module by that name, so a new engine is one new module here.
"""
