"""modeling subpackage."""
