"""The application: ``python -m shardkit.train`` trains the whole shardkit recipe (see
:mod:`shardkit.train.cli` for what it does and its flags).

Modules: :mod:`~shardkit.train.cli` (flags, entry point), :mod:`~shardkit.train.loop` (the
loop, checkpoints, Ctrl-C), :mod:`~shardkit.train.setup` (building data, model, head,
optimizers), :mod:`~shardkit.train.report` (evaluation, report, plot, progress bar),
:mod:`~shardkit.train.data` and :mod:`~shardkit.train.imagefolder` (datasets of uint8 images),
:mod:`~shardkit.train.models` (backbones), :mod:`~shardkit.train.metrics` (verification).
It uses the library wings only through their public names; nothing in them imports it.
"""

from shardkit.train.cli import main

__all__ = ["main"]
