"""`sluice preflight`: before a run gets its allocation, will this node feed it? (docs/preflight.md)

checks.py   objects reachable with their sizes, node cache integrity, tokenizer identity and backend,
            metrics port (no measurement)
rate.py     the rate this node delivers for the run spec, on the fly and from tokens, measured
verdict.py  that rate against R_req = N / S: keeps up or not, the margin, what to do
canary.py   a few steps through a real loaderd, kill -9, restore, the same stream as `sluice plan`
cli.py      the command; table.py its human output
"""
