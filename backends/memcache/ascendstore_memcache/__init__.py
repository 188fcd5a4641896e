"""AscendStore backend over MemCache (MemFabric): ``backend_config`` is
``MemcacheOptions``; the plugin is registered as ``memcache``. The layerwise
GVA flow (``gva_*`` methods, ``GlobalObject``) is in ``layerwise``."""

from ascendstore_memcache.layerwise import GlobalObject
from ascendstore_memcache.options import MemcacheOptions

__all__ = ["GlobalObject", "MemcacheOptions"]
