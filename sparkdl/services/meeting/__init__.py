"""The driver's meeting point: where a barrier stage's ranks meet before their process group exists."""
