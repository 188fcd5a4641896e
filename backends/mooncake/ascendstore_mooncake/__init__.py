"""Mooncake Store backend for AscendStore (entry point ``mooncake`` in ``ascendstore.backends``)."""

from ascendstore_mooncake.options import MooncakeOptions, resolve_options

__all__ = ["MooncakeOptions", "resolve_options"]
