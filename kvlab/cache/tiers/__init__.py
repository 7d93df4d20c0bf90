"""Tiers below the page pool: host memory and disk hold pages evicted from the prefix cache until a hit
brings them back (docs/design.md, "Tiers below the pool")."""
