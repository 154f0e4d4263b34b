"""Quality measures for the fill arms (seed 000, §3.1) and their paired intervals (§3.4)."""
