"""specdec: distributed speculative decoding. The shared library (math, models, sessions, stubs)."""
