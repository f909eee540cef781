"""The per-machine keeper (`snapfn keeper`, `snapfn pin`) and the memory it prepares for
tier-1 restores: regions made and filled beside criu, weight files kept pinned.

    daemon.py           the keeper: warm CUDA driver, CUDA restores, pinned files, its socket
    client.py           the restorer's end: one request per connection, or do it yourself
    pinned_cache.py     pinned host copies of snapshot files that outlive restores
    region_prefetch.py  the worker's regions, made and filled while criu restores it
    region_fill.py      the prefetch helper that makes and fills them, then hands them over
    file_mapping.py     a file mapped read-only and shared, for `cuMemHostRegister`
"""
