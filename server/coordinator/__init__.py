"""The coordinator: the public Generation API, routing to prefill/decode workers, detokenization.

`main.serve(CoordinatorConfig(...))` runs the process; `service.py` holds one request's life cycle.
"""
