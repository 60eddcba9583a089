"""pdserve: disaggregated prefill (JAX) / decode (torch) LLM serving."""
