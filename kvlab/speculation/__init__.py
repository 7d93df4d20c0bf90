"""The speculation room: draft plugins (`drafts`), the lossless verifiers (chain and token tree) and the
speculator that proposes, verifies and rolls back tentative tokens for the engine."""
