"""The engine: one round loop (``round``) driven end to end (``driver``), interchangeable executors
(``executors``; Flower's is in ``fedmtl.flower``), client state kept per client in a ``ClientStore``
(``store``), the systems model (``systems``), evaluation summaries and safe checkpoints."""
