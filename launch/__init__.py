"""The launchers, installed as the package ``distnorm.launch.scripts`` (``pyproject.toml`` maps
it onto this directory): ``python -m distnorm.launch torchrun CONFIG`` runs this
``torchrun.sh`` from an install, and ``python -m distnorm.launch path accelerate/multi_gpu.yaml``
names a shipped file.

Only a marker, holding no code: setuptools' editable install finds a mapped package by it."""
