"""``kernel_ladder``'s layers for Hugging Face's ``kernels`` loader: a local layer repository.

This folder is what ``kernels.LocalLayerRepository(repo_path=<this folder>, layer_name=...)`` loads:
``metadata.json`` (the kernel's name, id and license, as ``kernels`` requires of a build) next to this
``__init__.py``, whose ``layers`` module holds the layer classes. ``kernels`` imports the folder as a
module of its own (named by the id in ``metadata.json``), so everything here imports ``kernel_ladder``
by its absolute name. :func:`kernel_ladder.hf.kernel_mapping` builds the mapping that points at it.
"""

from . import layers

__all__ = ["layers"]
