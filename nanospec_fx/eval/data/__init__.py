"""Data bundled with the evaluation (``sample.jsonl``: a small offline corpus for ``--corpus sample``)."""
