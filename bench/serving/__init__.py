"""The serving benchmark: workloads sent over HTTP to a running server, vLLM's metrics.

``flashserve bench`` (``flashserve/bench_cmd.py``) wires these modules together:
``workloads`` builds sessions, ``arrivals`` spaces them, ``client`` streams each
request and times its chunks, ``metrics`` reduces the records, ``report`` prints
and plots them, ``launch`` starts a server, ``compare`` runs the ablations.
"""
