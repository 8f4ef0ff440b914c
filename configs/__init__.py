"""The recipes, installed as the package ``distnorm.recipes`` (``pyproject.toml`` maps it onto
this directory), so that ``distnorm-train --config imagenet/resnet50_cbn`` finds them by name
through ``importlib.resources`` in a wheel and in an editable install alike.

Only a marker, holding no code: setuptools' editable install finds a mapped package by it."""
