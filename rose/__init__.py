"""rose package."""
