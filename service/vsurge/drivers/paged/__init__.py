"""oDriver, the threads that feed oEngine, with its page scheduler (`PageScheduler`)."""
