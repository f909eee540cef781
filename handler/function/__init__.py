"""Hosting a function in a worker process: what the front doors run and how it comes up.

runtime.py       `WorkerRuntime`: one function (the LLM or a user's) brought up in this
                 worker — cold init, snapshot, restore — then invoked
target.py        what a worker serves (`ServeTarget`) and the 503 error (`NotReady`)
target_flags.py  the target flags `snapfn serve` and `snapfn worker` share
user_function.py a user's module:handler as a snapshot function: cold init, tier 0, restore
host.py          a user's function as a process-snapshot host (tier 1), and its remote handler
device_memory.py its CUDA allocations in a releasable pool, kept out of the process image
"""
