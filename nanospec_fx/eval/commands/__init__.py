"""The ``nanospec-fx`` verbs, one module each (imported only when the verb runs or is listed)."""
