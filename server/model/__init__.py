"""Model loading shared by every tier: HF config, safetensors weights, tokenizer."""
