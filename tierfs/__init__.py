"""tierfs: a tiered checkpoint store for ML training (RAM, peers, Google Cloud Storage)."""

__version__ = "0.1.0"
