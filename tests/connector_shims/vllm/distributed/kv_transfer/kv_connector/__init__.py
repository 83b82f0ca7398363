"""Stand-in package."""
