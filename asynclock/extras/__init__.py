"""Store-specific extras built on a client and its leases (they live above the backends)."""
