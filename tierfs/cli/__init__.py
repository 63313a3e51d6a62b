"""The ``tierfs`` command line."""
