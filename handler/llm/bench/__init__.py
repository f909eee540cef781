"""`snapfn bench`: cold-start modes side by side, each in a fresh process.

cli.py     the command: modes, floors, the report table and its waterfall
child.py   one mode, run in a fresh process
"""
