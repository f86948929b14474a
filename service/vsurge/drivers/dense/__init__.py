"""vDriver, the threads that feed vEngine, with its slot scheduler (`DenseSlots`)."""
