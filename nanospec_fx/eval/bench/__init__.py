"""Timing at real shapes: the LM head alone, a whole draft round, and end-to-end generation."""
