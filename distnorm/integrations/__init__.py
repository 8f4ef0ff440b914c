"""Engine integrations, imported lazily so that ``import distnorm`` needs only torch.

* :mod:`distnorm.integrations.accelerate` — Hugging Face Accelerate (``pip install distnorm[accelerate]``)
* :mod:`distnorm.integrations.deepspeed` — DeepSpeed, ZeRO stages 0–3 (``pip install distnorm[deepspeed]``)
"""
