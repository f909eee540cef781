"""Tier 1: a warmed worker process checkpointed with CRIU (and the CUDA driver), its large
memory kept out of the image, restored and handed back to its owner.

    snapshot.py       build a snapshot holding a process image, and restore from it
    worker_process.py spawn a worker, checkpoint it, restore it
    worker.py         the checkpointed process: init, wait, be dumped, be restored
    client.py         the owner's end of a restored worker: requests by id, replies routed
    pipe_channel.py   JSON lines over a pair of pipes between the two
    identity.py       a restored process made unique again (seeds, ids)
    criu.py           CRIU as a subprocess: find, check, dump, restore
    criu_image.py     criu's image files, read and written without criu
    image_memory.py   large anonymous memory moved out of the page image into a mapped file
    smaps.py          what the image will hold, from /proc/PID/smaps
    proc_stat.py      /proc/PID/stat without psutil
    doctor.py         `snapfn doctor`: which tier this machine can run, and why not
"""
