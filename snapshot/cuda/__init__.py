"""The CUDA driver, without torch: what the process tier needs below the framework.

driver.py      the driver API through `cuda.bindings`
checkpoint.py  the driver's checkpoint API, called on another process's pid
regions.py     releasable regions: pages given back while their addresses stay valid
"""
