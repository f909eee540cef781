"""Snapshots in S3 (`snapfn push` / `pull`) and the local cache of pulled ones.

transfer.py      push a published snapshot, pull one back (verified, resumable, atomic)
s3.py            where a snapshot lives, clients, ranged reads, progress
pull_staging.py  where a pull writes before it publishes, and its journal
arrivals.py      which ranges of a pull in flight are verified, for readers that follow it
overlap.py       a pull on its own thread that a restore follows
floor.py         the bytes' floor: a pull's GETs into memory, for the benchmark
cache.py         the local LRU cache behind `--snapshot s3://…`
cli.py           `snapfn push` and `snapfn pull`
"""
