"""The bottom layer: configuration, settings, sizes, the MTC control-file formats and Linux calls.

Nothing here imports another tierfs package."""
