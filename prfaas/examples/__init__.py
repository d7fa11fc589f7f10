"""Example deployment profiles shipped with the package."""
