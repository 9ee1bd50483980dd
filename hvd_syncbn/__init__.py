"""Synchronized batch normalization for Horovod."""
