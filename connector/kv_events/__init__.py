"""An engine's KV-cache events, read where the engine runs: where they come from, and what the
node agent makes of them."""
