"""`snapfn push SNAPSHOT s3://bucket/prefix` and `snapfn pull s3://bucket/prefix DIR`.

Both take `--endpoint-url URL` (an S3-compatible endpoint); without it boto3 reads
AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL, then its usual configuration. Progress and the summary
go to stderr; stdout gets one line naming what was written. A refusal exits 2 with its one-line
reason (cli.py). transfer.py holds the contract.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from snapfn.snapshot.errors import BadRequest
from snapfn.snapshot.store.transfer import DEFAULT_NUM_THREADS


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--endpoint-url", help="S3 endpoint (default: AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL)"
    )
    p.add_argument("--threads", type=int, default=DEFAULT_NUM_THREADS, help="parallel requests")


def _threads(args: argparse.Namespace) -> int:
    if args.threads < 1:
        raise BadRequest(f"--threads must be >= 1, got {args.threads}")
    return args.threads


def add_push_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("snapshot", type=Path, help="a published snapshot directory")
    p.add_argument("uri", metavar="s3://BUCKET/PREFIX", help="where to store it")
    _add_common(p)


def add_pull_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("uri", metavar="s3://BUCKET/PREFIX", help="a snapshot pushed there")
    p.add_argument("dest", type=Path, metavar="DIR", help="where to publish it")
    _add_common(p)


def run_push(args: argparse.Namespace) -> int:
    from snapfn.snapshot.store.transfer import push

    push(args.snapshot, args.uri, endpoint_url=args.endpoint_url, num_threads=_threads(args))
    print(f"snapshot pushed to {args.uri}")
    return 0


def run_pull(args: argparse.Namespace) -> int:
    from snapfn.snapshot.store.transfer import pull

    dest = pull(args.uri, args.dest, endpoint_url=args.endpoint_url, num_threads=_threads(args))
    print(f"snapshot pulled into {dest}")
    return 0
