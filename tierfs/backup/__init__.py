"""The durable plane: backup rounds in a GCS bucket (MTC layout), their judging and retention."""
