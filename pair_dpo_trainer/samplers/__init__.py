"""samplers subpackage."""
