"""The recurrent math gatelens writes itself: PyTorch's cell equations as pure functions
(``equations``), the same equations in place and time-major (``kernels``), and gatelens's own
modern cells with their parallel scan (``modern``, ``scan``). Nothing here knows about
families, traces or reports."""
