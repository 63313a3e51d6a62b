"""The peer data plane: replicate sealed steps to peers and serve their copies back."""
