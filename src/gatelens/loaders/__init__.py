"""Models from files gatelens did not write: ONNX graphs and Keras files (docs/formats.md).

``open_onnx``, ``trace_onnx`` and ``open_keras`` import their optional packages (onnx,
onnxruntime, h5py) only when called.
"""
