"""Cluster agreement: the coordinator, restore decisions, backup schedule and peer placement."""
