"""Speculative decoding on the decode tier: proposals (n-gram, or a draft model's), verified in one multi-position
step."""
