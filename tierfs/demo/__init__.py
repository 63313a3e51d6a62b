"""``tierfs demo``: a real PyTorch job on 4 local tierfs nodes surviving node and cluster loss."""
