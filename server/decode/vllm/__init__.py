"""The decode tier on vLLM's engine: the engine adapter (`engine.py`) and its start-up (`worker.py`), pdserve's
KV connector that vLLM loads by module path (`connector.py`, writing through `kv_writer.py` into the tables of
vLLM's KV cache groups, `cache_groups.py`), the received KV waiting for it (`staging.py`), vLLM's speculation
counts on pdserve's metrics (`spec_stats.py`), and whether an interpreter runs vLLM here at all (`probe.py`).

Importing this package imports no vLLM: only `connector.py`, `kv_writer.py`, `spec_stats.py` and what `worker.py`
builds do."""
