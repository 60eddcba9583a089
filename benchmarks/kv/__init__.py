"""The KV handoff: the transfer at wire speed against raw grpcio (`stream.py`, with `push.py`, `receiving_side.py`,
`receiver_process.py`), the latency the handoff adds (`handoff.py`), sliding windows' KV bytes (`window.py`) and
the host offload tier's repeat-prompt TTFT (`offload_ttft.py`)."""
