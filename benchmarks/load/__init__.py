"""Served systems under load: vLLM vs pdserve side by side (`side_by_side.py`), goodput against rate
(`goodput.py`), prefill overload, decode scheduling, conversations' and a draft's TTFT, the coordinator's relay
(`coordinator.py` with `fake_workers.py`, `sse_client.py`, `stream_count.py`), the workers' profiles
(`profile.py`), and the vLLM peers' helpers (`vllm_env.py`, `vllm_pd_proxy.py`)."""
