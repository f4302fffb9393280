"""ivy package."""
