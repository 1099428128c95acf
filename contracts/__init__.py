"""What every service shares: the block hash and the typed configuration."""
