"""integrity subpackage."""
