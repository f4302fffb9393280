"""tulip package."""
