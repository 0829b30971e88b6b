"""gatelens: open small recurrent language models.

Every gate of nn.LSTM, nn.GRU and nn.RNN as a tensor, verified against PyTorch, and
measurements of how long the model really remembers.
"""

__version__ = "0.1.0"
