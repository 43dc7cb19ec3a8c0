"""The host-side engine: requests, scheduler, KV-page manager, detokenizer, engine loops."""
