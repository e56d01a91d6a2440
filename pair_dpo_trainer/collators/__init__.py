"""collators subpackage."""
