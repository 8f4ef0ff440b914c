"""The training recipe: ``distnorm-train --config configs/....yaml [overrides]``.

Built on the plugin API (:mod:`distnorm.integrations`), the WebDataset loaders
(:mod:`distnorm.data`) and the model zoo (:mod:`distnorm.models`); the engine (Accelerate
or DeepSpeed) is chosen in the config.
"""

from distnorm.train.config import TrainConfig, load_config

__all__ = ["TrainConfig", "load_config"]
