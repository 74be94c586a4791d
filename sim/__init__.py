"""slipstream."""
