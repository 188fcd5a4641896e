"""GR mode on vLLM: the device-side user-level LRU (``user_lru``), the hooks a
connector calls (``hooks``, ``wiring``), the GR-only connector (``connector``)
and GR statistics (``stats``). The vLLM-free core is ``ascendstore.gr``.

Importing this package imports neither vLLM nor torch; its modules do.
"""
