"""Speculative decoding on the decode tier: proposals (n-gram), verified in one multi-position step."""
