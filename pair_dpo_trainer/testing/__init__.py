"""Helpers for tests of the package and of code built on it (as ``torch.testing``); the training path never imports
them."""
