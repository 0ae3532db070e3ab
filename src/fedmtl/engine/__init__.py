"""The engine: one round loop (``round``), interchangeable executors (``executors``; the distributed one in
``distributed``, Flower's in ``fedmtl.flower``), client state kept per client in a ``ClientStore`` (``store``), the
update pipeline (``updates`` and ``steps``), the systems model (``systems``) and evaluation summaries
(``evaluation``).  What runs around the rounds (the run directory, checkpoints, seeds, reports) is ``fedmtl.runs``."""
