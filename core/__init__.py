"""The data model every other room stands on: block keys and namespaces, KV layouts and the
model catalog, buffers. It imports nothing of kvstrata but ``errors`` and ``units``."""
