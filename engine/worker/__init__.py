"""Running one scheduled step: the flat batch, the model call, sampling."""
