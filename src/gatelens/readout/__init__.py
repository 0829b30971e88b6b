"""The read-out: ``trace``, ``verify`` and ``open_cells`` on top of the families."""
