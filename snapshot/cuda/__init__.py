"""Device memory below the framework: the CUDA driver, its checkpoint API, and memory that is
given back before a checkpoint and mapped again at the same addresses after a restore.

driver.py      the driver API through `cuda.bindings`
checkpoint.py  the driver's checkpoint API, called on another process's pid
regions.py     releasable regions: pages given back while their addresses stay valid
span.py        one reserved range mapped piece by piece, given back together; SpanPool
host_registered.py  pinned host memory made fast: huge-page anonymous memory registered at once
"""
