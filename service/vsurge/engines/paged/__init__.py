"""oEngine: the paged engine (KV in pages, prefix caching), its page manager, mixed step and programs."""
