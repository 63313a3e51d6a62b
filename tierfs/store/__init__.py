"""The RAM store on tmpfs: its layout, the byte budget, manifests and sealed shards.

Blocking code only: callers on the trio thread run it in worker threads.
"""
