"""The update pipeline's steps, one module each (composed by ``fedmtl.engine.updates``)."""
