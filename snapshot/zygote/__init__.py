"""A pre-imported fork server, so a worker starts in milliseconds instead of seconds.

owner.py        the zygote's owner: start it, ask it to fork workers
server.py       the zygote process: preload, check fork safety, serve fork requests
channel.py      its wire protocol and the JSON-lines `Channel` to a worker
fork_safety.py  what must hold before a fork, and what a child resets after
"""
