"""A preload module that leaves CUDA initialised, as a careless function module would.

On a CUDA machine it really initialises CUDA; on a CPU machine it makes
`torch.cuda.is_initialized()` answer True, which is all the zygote's check can see.
"""

import torch

if torch.cuda.is_available():
    torch.cuda.init()
else:
    torch.cuda.is_initialized = lambda: True
