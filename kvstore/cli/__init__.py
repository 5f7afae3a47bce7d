"""The ``kvstore`` command: ``main`` parses and dispatches; ``status``, ``cache`` and
``credentials`` are its operator command groups."""
