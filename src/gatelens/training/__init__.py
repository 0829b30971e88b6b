"""Training character-level models: corpora, the model, the loop, the run directory."""
