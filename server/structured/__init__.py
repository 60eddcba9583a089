"""Structured output: a request's StructuredOutput as an llguidance grammar (`output_spec.py`), compiled once per
(grammar, tokenizer) (`grammars.py`), followed token by token by each sequence (`constraint.py`) as a
packed int32 bitmask over the vocabulary (`bitmask.py`). Pure Python and numpy: the coordinator, the JAX
prefill tier and the torch decode tier all import it."""
