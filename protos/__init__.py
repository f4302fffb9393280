"""protos package."""
