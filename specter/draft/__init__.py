"""The draft side: the draft step as a CUDA graph (compiled where asked), and draft-ahead on its side stream."""
