"""Snapshots in S3 (`snapfn push` / `pull`) and the local cache of pulled ones.

transfer.py      push a published snapshot, pull one back (verified, resumable, atomic)
s3.py            where a snapshot lives, clients, ranged reads, progress
pull_staging.py  where a pull writes before it publishes, and its journal
cache.py         the local LRU cache behind `--snapshot s3://…`
cli.py           `snapfn push` and `snapfn pull`
"""
