"""vEngine: the dense engine (one KV row per slot) and its programs."""
