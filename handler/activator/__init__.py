"""Scale to zero: a light front process (aiohttp, no torch) that owns the port, starts
`snapfn serve` instances on demand, routes to them and stops them when idle.

    app.py            `snapfn serve --idle-timeout …`: the activator's routes and its lifecycle
    pool.py           the instances: routing, the hold queue, scaling up, idling out to zero
    proxy.py          one request relayed to an instance, its response streamed back
    connection.py     the client connections: malformed requests in JSON, a receive deadline
    instance.py       one instance: `snapfn serve` as a subprocess on a loopback port
    plan.py           each instance's command line, environment and GPU
    keepers.py        one `snapfn keeper` per GPU beside the instances (`--keeper on`)
    metrics.py        the activator's Prometheus registry
    parent_watch.py   an instance never outlives its activator
    process_group.py  signal and clear an instance's whole process group
"""
