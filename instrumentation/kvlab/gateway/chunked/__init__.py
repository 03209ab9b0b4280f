"""Chunked decoding (issue 23, docs/chunked-decoding.md): generation in time slices of N tokens.

`slots.py` decides which waiting chunk runs next (priority, tenant fairness, aging); `splice.py`
runs one request's chunks on its replica and joins them into one response or stream.
"""
