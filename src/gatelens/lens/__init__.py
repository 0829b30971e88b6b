"""The ways in: a run directory, a weights file, or any nn.Module, all through ``Lens``."""
