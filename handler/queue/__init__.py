"""`snapfn worker`: batch jobs from an SQS queue (and the Lambda-style SQS batch handler).

cli.py        the command: flags, boto3 clients, signals, the wait for the runtime
worker.py     `QueueWorker`: receive, run, delete or give back, heartbeat, drain
inflight.py   the held jobs and their messages, kept visible
jobs.py       the wire format of a job message and of its result document
runner.py     a job's work in the runtime, and the writing of its result
results.py    durable, at-most-once result writes
"""
